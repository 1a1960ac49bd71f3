"""``loadtest.router_ab``: its arguments and its accounting of the CPU of a runtime's processes (wrk's
report is read by ``loadtest.wrk``: ``tests/unit/test_wrk.py``)."""

from __future__ import annotations

import pytest

from loadtest.router_ab import main


def test_bad_arguments_are_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([".", ".", "--seconds", "0"])
    assert e.value.code == 2 and "--seconds 1-60" in capsys.readouterr().err


def test_the_rest_of_a_runtime_is_every_process_under_its_router() -> None:
    """The worker's side of a turn is measured from the processes under the router: children and their
    children are found, and only processes alive at both readings are counted."""
    import subprocess
    import time

    from loadtest.proctree import descendants
    from loadtest.router_ab import _rest_s

    root = subprocess.Popen(["bash", "-c", "bash -c 'sleep 30 & wait' & sleep 30 & wait"])
    try:
        for _ in range(100):  # the grandchild starts a moment later
            if len(found := descendants(root.pid)) >= 3:
                break
            time.sleep(0.05)
        # the inner bash and a sleep under the root, and the inner bash's sleep under it
        parents = {int(open(f"/proc/{p}/stat").read().rpartition(")")[2].split()[1]) for p in found}
        assert len(found) == 3 and root.pid not in found and len(parents) == 2, found
    finally:
        root.kill()
        subprocess.run(["pkill", "-P", str(root.pid)], check=False)
        root.wait()
    assert _rest_s({1: 1.0, 2: 5.0}, {1: 1.5, 3: 9.0}) == 0.5, "a process that came or went is left out"
