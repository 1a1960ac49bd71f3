"""A session's own state as the agent sees it, through the real runtime: state that cannot be loaded
(a poisoned notebook pickle) is that session's problem only, and large notebook state suspends within
the template's limits or is refused with the limit named while the session keeps running."""

from __future__ import annotations

import pytest

from substrate.client import ApiError

#: cells that leave a variable whose unpickling ends the process that loads it (the agent host, before)
POISON = {
    "SystemExit": "class P:\n    def __reduce__(self):\n        return (exec, ('raise SystemExit(3)',))\np = P()",
    "exit status 3": "import os\nclass P:\n    def __reduce__(self):\n        return (os._exit, (3,))\np = P()",
}

LIMITED_TEMPLATES = """
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: notebook-small}
spec:
  entrypoint: workers.agents.notebook:Notebook
  isolation: {maxMemory: 256Mi}
---
apiVersion: substrate.agent.dev/v1
kind: ActorTemplate
metadata: {name: notebook-disk}
spec:
  entrypoint: workers.agents.notebook:Notebook
  isolation: {maxDiskBytes: 16Mi}
"""

BREAKER_FAILURES = 3


@pytest.mark.parametrize("kind", list(POISON))
def test_poisoned_notebook_state_fails_only_its_own_wake(runtime_factory, kind):
    rt = runtime_factory(replicas=1, slots=4, env={"SUBSTRATE_QUOTA__BREAKER_FAILURES": str(BREAKER_FAILURES)})
    c = rt.client
    nb = c.create_session("notebook")
    c.invoke(nb["id"], "a = [1, 2, 3]\n" + POISON[kind])
    c.suspend(nb["id"])
    for _ in range(BREAKER_FAILURES + 2):  # past the breaker's threshold
        with pytest.raises(ApiError) as err:
            c.invoke(nb["id"], "1 + 1")
        assert (err.value.status, err.value.code) == (422, "state_load_failed"), err.value
        assert err.value.details.get("exception") == kind and kind in err.value.message
        s = c.get_session(nb["id"])
        assert (s["state"], s["reason"]) == ("FAILED", "state_load_failed")
        assert s["snapshot"] is not None, "the snapshot is kept (not rolled back, not forgotten)"
        # the same tenant's other sessions are not refused: the breaker did not count the failure
        other = c.create_session("counter")
        c.invoke(other["id"], "increment")
        c.suspend(other["id"])
        assert c.invoke(other["id"], "increment") == {"count": 2}
        c.delete_session(other["id"])
    c.delete_session(nb["id"])
    with pytest.raises(ApiError) as err:
        c.get_session(nb["id"])
    assert err.value.status == 404


def test_large_notebook_variable_suspends_within_the_memory_limit(runtime_factory):
    # 96 MiB under a 256 MiB limit: pickling it through in-memory copies (two of them) went over and
    # the memory cgroup killed the agent, losing the variable (the 450 MiB-under-1 GiB report, scaled)
    rt = runtime_factory(replicas=1, slots=2, extra_yaml=LIMITED_TEMPLATES)
    c = rt.client
    nb = c.create_session("notebook-small")
    c.invoke(nb["id"], "x = bytearray(96 * 1024 * 1024)\nx[-1] = 7\nlen(x)")
    c.suspend(nb["id"])
    assert c.get_session(nb["id"])["state"] == "SUSPENDED"
    out = c.invoke(nb["id"], "len(x), x[-1]")
    assert out["repr"] == f"({96 * 1024 * 1024}, 7)" and "warning" not in out


def test_notebook_state_over_the_disk_limit_refuses_the_suspend_and_keeps_running(runtime_factory):
    rt = runtime_factory(replicas=1, slots=2, extra_yaml=LIMITED_TEMPLATES)
    c = rt.client
    nb = c.create_session("notebook-disk")
    c.invoke(nb["id"], "import os\nx = bytearray(os.urandom(24 * 1024 * 1024))\nh = hash(bytes(x))")
    with pytest.raises(ApiError) as err:
        c.suspend(nb["id"])
    assert (err.value.status, err.value.code) == (422, "state_too_large"), err.value
    assert "isolation.maxDiskBytes" in err.value.message and str(16 * 1024 * 1024) in err.value.message
    s = c.get_session(nb["id"])
    assert s["state"] == "RUNNING" and s["epoch"] == nb["epoch"], "same activation, nothing lost"
    assert c.invoke(nb["id"], "hash(bytes(x)) == h")["repr"] == "True"
    c.invoke(nb["id"], "del x")
    c.suspend(nb["id"])
    assert c.invoke(nb["id"], "h == h")["repr"] == "True"
