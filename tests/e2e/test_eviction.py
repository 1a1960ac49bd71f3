"""A session whose own content refuses its snapshot does not hold its slot against everyone else.

Fresh-user run 35: on a fixed pool, one tenant's sessions with workspaces over their template's
``maxDiskBytes`` (each file under the per-file limit, the total over it) could not be suspended, so slot
pressure skipped them for good and every other tenant got 503 ``no_capacity``. A pressure suspend that the
session's own content refuses now evicts it: SUSPENDED from its last committed snapshot under a new
epoch (reason ``evicted``), the slot freed, and its next answer says ``X-Substrate-Restored: evicted``.
An explicit suspend still refuses with 422 and changes nothing.
"""

from __future__ import annotations

import time

import pytest

from substrate.client import ApiError

SMALL = """
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: shell-small}
spec:
  entrypoint: workers.agents.shell:Shell
  isolation: {maxDiskBytes: 1Mi}
"""

#: two files of 700,000 bytes: each under the 1 MiB per-file limit, together over the workspace's
FILL = "head -c 700000 /dev/zero > a && head -c 700000 /dev/zero > b && echo 2 > n"


def _wait_state(c, sid: str, state: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        rec = c.get_session(sid)
        if rec["state"] == state or time.monotonic() > deadline:
            return rec
        time.sleep(0.1)


def test_a_session_its_own_workspace_keeps_from_suspending_is_evicted_under_slot_pressure(runtime_factory):
    rt = runtime_factory(replicas=1, slots=2, extra_yaml=SMALL,
                         env={"SUBSTRATE_API__PRESSURE_MIN_IDLE_S": "0.2", "SUBSTRATE_API__SLOT_WAIT_S": "20"})
    c = rt.client
    hog = c.create_session("shell-small")["id"]
    assert c.invoke(hog, "echo 1 > n")["exitCode"] == 0
    c.suspend(hog)  # its last committed snapshot: n = 1
    first = c.get_session(hog)
    assert c.invoke(hog, FILL)["exitCode"] == 0  # woken: n = 2, and a workspace over 1 MiB
    # refused at an explicit suspend, which changes nothing
    with pytest.raises(ApiError) as e:
        c.suspend(hog)
    assert e.value.status == 422 and e.value.code == "workspace_too_large", e.value
    assert c.get_session(hog)["state"] == "RUNNING"
    other = c.create_session("shell-small")["id"]  # the pool's second slot, over its limit too
    assert c.invoke(other, FILL)["exitCode"] == 0
    time.sleep(0.5)  # both idle past the pressure threshold; the first hog least recently used
    # a third session needs a slot, and both held ones refuse their snapshots: it was 503 no_capacity
    third = c.create_session("shell")["id"]
    assert c.get_session(third)["state"] == "RUNNING"
    hog_rec = _wait_state(c, hog, "SUSPENDED")
    assert hog_rec["state"] == "SUSPENDED" and hog_rec["reason"] == "evicted", hog_rec
    assert hog_rec["epoch"] > first["epoch"] + 1  # the evicted activation's epoch is fenced
    assert c.get_session(other)["state"] == "RUNNING", "one slot was needed: one session evicted"
    # the next turn comes back from the last snapshot and says so
    c.delete_session(third)
    ans = c.invoke_answer(hog, "cat n; ls")
    assert ans.restored is not None and ans.restored.startswith("evicted"), ans
    assert ans.output["stdout"].split() == ["1", "n"], ans.output
    events = c.session_events(hog)["items"]
    evict = [ev for ev in events if ev["action"] == "evict"]
    assert len(evict) == 1 and evict[0]["reason"] == "workspace_too_large", events
