"""``loadtest.router_ab`` reads wrk's report: the count and the time it took, and refuses a run in which
any answer failed (a router answering errors fast would look cheap per turn)."""

from __future__ import annotations

import pytest

from loadtest.router_ab import main, parse_wrk

REPORT = """Running 5s test @ http://127.0.0.1:20393/v1/sessions/s-1/invoke
  1 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    10.19ms    2.48ms  29.93ms   84.19%
    Req/Sec     1.58k   180.11     1.90k    70.00%
  7878 requests in 5.01s, 1.49MB read
Requests/sec:   1572.32
Transfer/sec:    304.65KB
"""


def test_the_count_and_the_time_are_read() -> None:
    assert parse_wrk(REPORT) == (7878, 5.01)
    assert parse_wrk(REPORT.replace("in 5.01s", "in 1.00m")) == (7878, 60.0)


@pytest.mark.parametrize("bad", ["  Non-2xx or 3xx responses: 12\n", "  Socket errors: connect 0, read 3, write 0, timeout 0\n"])
def test_a_run_with_failed_answers_is_refused(bad: str) -> None:
    with pytest.raises(RuntimeError, match="wrk saw errors"):
        parse_wrk(REPORT + bad)
    with pytest.raises(RuntimeError, match="no request count"):
        parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n")


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
