"""A session whose template was removed from the config (fresh-user round 15: its next call answered
"unknown actorTemplate 'x' (known: ...)", which reads as if the request had named a template)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, dedent

EXTRA = dedent("""
    ---
    apiVersion: substrate.agent.dev/v1
    kind: ActorTemplate
    metadata: {name: soon-gone}
    spec:
      entrypoint: workers.agents.counter:Counter
""")


def test_a_session_of_a_removed_template_says_so_keeps_its_snapshot_and_can_be_deleted(runtime_factory) -> None:
    rt = runtime_factory(replicas=1, slots=2, extra_yaml=EXTRA)
    c = rt.client
    sid = c.create_session("soon-gone")["id"]
    assert c.invoke(sid, "increment") == {"count": 1}
    assert c.suspend(sid)["state"] == "SUSPENDED"
    templates = Path(rt.env["SUBSTRATE_CONFIG_DIR"]) / "templates.yaml"
    templates.write_text(templates.read_text().replace(EXTRA, ""))
    rt.restart()
    r = c.http.post(f"/v1/sessions/{sid}/invoke", json={"input": "get"})
    assert (r.status_code, r.json()["code"]) == (422, "unknown_template"), r.text
    msg = r.json()["message"]
    assert f"session '{sid}' uses actorTemplate 'soon-gone'" in msg and "no longer defines" in msg, msg
    assert "DELETE" in msg and r.json()["details"] == {"actorTemplate": "soon-gone", "reason": "template_removed"}
    # the CLI: not "fix the command" (exit 2): the command was fine, the server's config lost the template
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SUBSTRATE_")}, "SUBSTRATE_SERVER": rt.url}
    cli = subprocess.run([sys.executable, "-m", "substrate.cli", "sessions", "invoke", sid, "get"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 1 and "422 unknown_template" in cli.stderr, (cli.returncode, cli.stderr)
    s = c.get_session(sid)
    assert s["state"] == "SUSPENDED" and s["snapshot"] is not None
    c.delete_session(sid)
