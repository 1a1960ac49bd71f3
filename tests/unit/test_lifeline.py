"""``workers/lifeline.py``: a local worker's tie to the runtime that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from tests.conftest import ROOT

#: the child: a "worker" whose graceful stop hangs (SIGTERM only noted), watching the lifeline
CHILD = textwrap.dedent("""
    import logging, pathlib, signal, sys, time
    from workers import lifeline
    logging.basicConfig(level=logging.WARNING)  # to stderr, through descriptor 2, as the worker's logging
    def on_term(*_):
        print("sigterm", flush=True)
        for i in range(10):  # a stopping worker's repeated warnings
            logging.getLogger("w").warning("heartbeat failed %d", i)

    signal.signal(signal.SIGTERM, on_term)
    log_path = pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else None
    print(lifeline.watch_from_env(float(sys.argv[1]), log_path=log_path), flush=True)
    time.sleep(600)
""")


def _child(fd: int | None, escalate_after_s: float, *log_path: str, **kw: object) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "SUBSTRATE_LIFELINE_FD"}
    if fd is not None:
        env["SUBSTRATE_LIFELINE_FD"] = str(fd)
    return subprocess.Popen([sys.executable, "-c", CHILD, str(escalate_after_s), *log_path], cwd=ROOT, env=env,
                            text=True, stdout=subprocess.PIPE, pass_fds=() if fd is None else (fd,), **kw)  # type: ignore[call-overload]


def test_the_runtime_gone_means_sigterm_then_sigkill_after_the_grace() -> None:
    r, w = os.pipe()
    p = _child(r, 1.0)
    os.close(r)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "True"
        os.close(w)  # what the kernel does when the runtime dies, SIGKILL included
        assert p.stdout.readline().strip() == "sigterm", "the graceful stop is asked for first"
        assert p.wait(60) == -signal.SIGKILL, "a graceful stop that hangs is cut short"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_runtime_that_died_before_the_watch_started_is_seen_at_once() -> None:
    r, w = os.pipe()
    os.close(w)  # the runtime died between starting the worker and the worker's first read
    p = _child(r, 0.0)
    os.close(r)
    try:
        assert p.wait(60) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_without_a_lifeline_nothing_is_watched() -> None:
    """Kubernetes workers (``substrate worker``) get no descriptor: their life is the Pod's."""
    p = _child(None, 0.0)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "False"
    finally:
        p.kill()
        p.wait()


def test_once_the_runtime_is_gone_the_worker_writes_to_its_own_file_not_the_terminal(tmp_path) -> None:
    """A fresh-user run: after a forced exit of ``substrate up`` its workers, stopping on their own, printed
    about 50 warning lines into the shell that had its prompt back. From the runtime's end on, what a
    worker writes (its log records, anything on standard output or error) goes to its own file."""
    log_path = tmp_path / "logs" / "w1.after-runtime-exit.log"
    r, w = os.pipe()
    p = _child(r, 1.0, str(log_path), stderr=subprocess.PIPE)
    os.close(r)
    try:
        assert p.stdout is not None and p.stderr is not None and p.stdout.readline().strip() == "True"
        os.close(w)
        assert p.wait(60) == -signal.SIGKILL
        assert p.stdout.read() == "", "nothing more on the terminal's standard output"
        assert p.stderr.read() == "", "nor on its standard error"
        text = log_path.read_text()
        assert "the runtime that started this worker is gone" in text and "sigterm" in text, text
        assert "graceful stop did not finish" in text, text
        assert [f"heartbeat failed {i}" in text for i in range(10)] == [True] * 3 + [False] * 7, \
            "each kind of record at most three times"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
