"""The local runtime refuses pools this machine cannot run, before anything starts.

Fresh-user round 11: ``spec.replicas: 100000`` loaded; the runtime forked about 830 workers within two
minutes, each with its sandbox reaper, and the machine's load average reached 3,200 (the reapers queued
on the cgroup folder's lock). ``substrate.backends.local.check_capacity`` now says so at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from substrate.backends.local import check_capacity, max_workers
from substrate.settings import Settings
from substrate.specs import SpecError, load_documents, parse_yaml_documents
from tests.cli_up import up_on_a_taken_port

TEMPLATE = """---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: counter}
spec: {entrypoint: 'workers.agents.counter:Counter', workerPool: a}
"""


def _pool(name: str, spec: str) -> str:
    return f"---\napiVersion: substrate.agent.dev/v1\nkind: WorkerPool\nmetadata: {{name: {name}}}\nspec: {spec}\n"


def _catalog(*pools: str):
    return load_documents(parse_yaml_documents("".join(pools) + TEMPLATE), "<test>", log_warnings=False)


def test_max_workers_is_replicas_or_the_autoscaling_bound() -> None:
    cat = _catalog(_pool("a", "{replicas: 3, slots: 2}"),
                   _pool("b", "{replicas: 1, slots: 2, autoscaling: {minReplicas: 0, maxReplicas: 40}}"))
    assert max_workers(cat.pools["a"].spec) == 3 and max_workers(cat.pools["b"].spec) == 40


def test_too_many_workers_in_all_pools_are_refused_naming_each_pool() -> None:
    s = Settings(pool={"local_max_workers": 50})
    cat = _catalog(_pool("a", "{replicas: 30, slots: 1}"),
                   _pool("b", "{slots: 2, autoscaling: {minReplicas: 0, maxReplicas: 21}}"))
    with pytest.raises(SpecError) as e:
        check_capacity(cat, s, source="cfg", as_root=False)
    msg = e.value.message
    assert e.value.code == "invalid_spec"
    assert msg.startswith("cfg: WorkerPool a: 30 workers (spec.replicas) x 1 slots; WorkerPool b: 21 workers "
                          "(spec.autoscaling.maxReplicas) x 2 slots: 51 worker processes in all, over the 50"), msg
    assert "SUBSTRATE_POOL__LOCAL_MAX_WORKERS" in msg
    # at the bound it loads
    check_capacity(_catalog(_pool("a", "{replicas: 29, slots: 1}"),
                            _pool("b", "{slots: 2, autoscaling: {minReplicas: 0, maxReplicas: 21}}")), s, as_root=False)


def test_more_sandboxes_than_sandbox_uids_are_refused_only_as_root() -> None:
    s = Settings(worker={"sandbox_uid_span": 100})
    cat = _catalog(_pool("a", "{replicas: 6, slots: 16}"))  # 96 slots and 6 spare sandboxes, 6 workers
    check_capacity(cat, s, as_root=False)  # not root: slots hold no uid of their own
    with pytest.raises(SpecError) as e:
        check_capacity(cat, s, as_root=True)
    assert e.value.message.startswith("WorkerPool a: 6 workers (spec.replicas) x 16 slots (+1 spare sandbox): "
                                      "102 sandboxes in all, over the 100 sandbox uids (SUBSTRATE_WORKER__SANDBOX_UID_SPAN")
    check_capacity(_catalog(_pool("a", "{replicas: 5, slots: 19}")), s, as_root=True)  # exactly 100
    # without spares each worker holds its slots' uids only
    check_capacity(cat, Settings(worker={"sandbox_uid_span": 100, "spare_sandboxes": 0}), as_root=True)
    check_capacity(cat, Settings(worker={"sandbox_uid_span": 100, "prestart_hosts": 0}), as_root=True)


def test_the_shipped_and_replay_configs_fit_the_defaults() -> None:
    from substrate.specs import load_catalog
    from substrate.settings import EXAMPLES_DIR

    root = Path(__file__).resolve().parents[2]
    for cfg in (EXAMPLES_DIR, root / "loadtest" / "config", root / "loadtest" / "config-baseline"):
        check_capacity(load_catalog(cfg), Settings(), as_root=True)


def test_up_with_a_huge_pool_is_one_error_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path / "var"))
    monkeypatch.delenv("SUBSTRATE_API__AUTH_TOKEN", raising=False)
    cfg = tmp_path / "config"
    cfg.mkdir()
    (cfg / "pool.yaml").write_text(_pool("a", "{replicas: 100000, slots: 4}"))
    (cfg / "templates.yaml").write_text(TEMPLATE)
    r = up_on_a_taken_port(cfg)  # were the check missing, `up` would stop at the port check
    assert r.exit_code == 2, r.output
    line = " ".join(r.output.split())
    assert line.startswith(f"error: {cfg}: WorkerPool a: 100000 workers (spec.replicas) x 4 slots: 100000 worker "
                           "processes in all, over the 512"), r.output
    assert "Traceback" not in r.output and not (tmp_path / "var").exists()  # nothing was started
