"""Open mode with a template whose agents have network egress warns at start: such an agent shares this
machine's network and can call the API, which asks no credentials in open mode (fresh-user round 14: an
egress agent deleted another session through ``DELETE http://127.0.0.1:<port>/v1/sessions/...``)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import dedent

EXTRA = dedent("""
    ---
    apiVersion: substrate.agent.dev/v1
    kind: ActorTemplate
    metadata: {name: shell-out}
    spec:
      entrypoint: workers.agents.shell:Shell
      isolation: {network: egress}
""")

WARNING = "open mode (no API keys) with templates whose agents have network egress (shell-out)"


@pytest.mark.parametrize("keys", [False, True])
def test_open_mode_with_an_egress_template_is_warned_of_at_start(runtime_factory, keys: bool) -> None:
    env = {"SUBSTRATE_AUTH__API_KEYS": json.dumps([{"tenant": "a", "key": "sk_" + "k" * 32}])} if keys else {}
    rt = runtime_factory(replicas=1, slots=2, extra_yaml=EXTRA, env=env)
    assert (WARNING in rt.logs()) is (not keys), rt.logs()[-2000:]


def test_a_pools_snapshot_storage_under_substrate_up_is_warned_of(runtime_factory) -> None:
    """``substrate up`` keeps every session's snapshots in its one store; a WorkerPool's
    ``snapshotStorage`` (applied on Kubernetes) was ignored without a word (fresh-user round 18)."""
    pool = dedent("""
        apiVersion: substrate.agent.dev/v1
        kind: WorkerPool
        metadata: {name: default}
        spec:
          replicas: 1
          slots: 2
          snapshotStorage: s3://other-bucket/pfx
    """)
    rt = runtime_factory(replicas=1, slots=2, pool_yaml=pool)
    assert ("WorkerPool default: spec.snapshotStorage s3://other-bucket/pfx is applied on Kubernetes only; "
            "substrate up keeps every session's snapshots in file://") in rt.logs(), rt.logs()[-2000:]
