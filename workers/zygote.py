"""Fork server for local workers: import everything once, then fork a worker per request.

A cold ``python -m workers.server`` spends most of its start-up importing (aiohttp, boto3, redis,
pydantic: ~0.5-1.5 s here); a fork of a process that already imported them starts serving in tens of
milliseconds (DESIGN.md's measured floor: ~370 ms cold vs ~40 ms forked). The local backend keeps one
zygote per runtime and talks to it in JSON lines:

    <- {"ready": true}                      (once, when the imports are done)
    -> {"worker_id": "default-1", "pool": "default", "slots": 16}
    <- {"worker_id": "default-1", "pid": 12345}

The zygote reaps its children at once, so a worker that ended no longer exists as a process (the
backend checks liveness with signal 0).

The zygote starts no thread and no event loop before forking (fork-safety). When its stdin closes (the
runtime went away, even by SIGKILL) it sends SIGTERM to every worker it forked and exits.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys


def _child(req: dict) -> None:
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # stdout belongs to the zygote's protocol: the worker logs to stderr only
    from workers.server import main

    try:
        main(["--pool", str(req["pool"]), "--slots", str(int(req["slots"])), "--worker-id", str(req["worker_id"])])
    except SystemExit as e:
        os._exit(e.code if isinstance(e.code, int) else 0)
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def main() -> None:
    # the imports a worker needs, done once here so every fork starts warm
    import aiohttp  # noqa: F401
    import boto3  # noqa: F401
    import botocore.session

    botocore.session.get_session().get_component("data_loader")  # warm botocore's model loader
    import kubernetes.utils  # noqa: F401 - quantity parsing of templates' isolation limits
    import workers.server  # noqa: F401
    from workers import syscalls

    try:
        syscalls.build_bpf()  # cached: every forked worker's sandboxes use this filter
    except syscalls.SeccompUnavailable:
        pass  # each worker finds out and says why (workers.sandbox)
    # Freeze the imported heap before forking (the gc docs' advice for pre-fork servers): a worker's
    # first full collection (substrate/gctune.py, at start-up) then walks only what the worker made,
    # not the ~10^5 objects imported here, and does not touch (copy) their pages. Measured: a forked
    # worker's start-up collection took ~70 ms of its ~270 ms to READY; ~1 ms after this.
    gc.collect()
    gc.freeze()

    children: set[int] = set()
    out = sys.stdout

    def say(msg: dict) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    def reap(*_: object) -> None:  # only reaps: a handler that wrote could interleave with say()
        while True:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)

    signal.signal(signal.SIGCHLD, reap)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the runtime stops us by closing stdin
    say({"ready": True})
    for line in sys.stdin:
        try:
            req = json.loads(line)
        except json.JSONDecodeError:
            continue
        pid = os.fork()
        if pid == 0:
            _child(req)
        children.add(pid)
        say({"worker_id": req.get("worker_id"), "pid": pid})
    for pid in list(children):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    main()
