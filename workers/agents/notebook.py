"""The notebook agent: runs Python cells; variables persist across turns and across suspend/resume.

Input is Python source. Output: ``stdout``, ``stderr``, ``repr`` of the last expression (or None),
``error`` (a traceback string) if the cell raised, and ``warning`` on the first answer after a resume
when something could not be restored.

Runs in the session's own agent host (``workers/agenthost.py``, inside its sandbox), so:

* cells run with the session's workspace as working directory (relative paths land in the workspace);
* output is captured per cell: the cell's namespace has its own ``print`` and ``sys.stdout``/``stderr``
  point at the cell's buffers while it runs. That redirection is process-wide, but the process is this
  session's alone, so no other session's output can ever mix in;
* a cell runs at most ``CELL_TIMEOUT_S`` seconds (template env; default: the template's turn timeout
  less 1 s, else 60 s): it then gets ``TimeoutError`` in the cell (a C call that never returns to Python
  is ended by the worker's turn timeout, which kills the sandbox);
* state: the namespace's picklable variables are pickled (protocol 5, streamed to the file: a large
  ``bytes``/``bytearray`` is written from its own buffer, never copied, so a suspend needs no memory
  beyond the variables themselves) into the workspace file ``.notebook/namespace.pkl`` and unpickled
  here, inside the sandbox, never by the worker. Imported modules are recorded by name and imported
  again on resume; functions and classes defined in cells cannot be pickled by reference, so they (and
  any unpicklable variable) are named in ``warning``. A file that does not fit the workspace's limits
  (``isolation.maxDiskBytes``) fails the snapshot with ``StateTooLarge`` (422 ``state_too_large``); the
  session keeps running with all its variables;
* loading state: the file is first unpickled in a forked child (a probe), so a variable whose unpickling
  ends the process (``os._exit``, ``SystemExit``, ``abort``) cannot take the host down. If unpickling
  raises an ordinary exception the variables are not restored and ``warning`` says so (as before); if
  it ends the probe (an exit status, ``SystemExit``/``KeyboardInterrupt``, a fatal signal) ``start``
  raises ``StateLoadFailed`` naming it: the wake answers 422 ``state_load_failed`` and the session is
  FAILED with its snapshot kept. A probe killed by SIGKILL (the memory limit, or a kill from outside) or
  running past its time is not taken as the state's fault: the start fails as one of the moment.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import errno
import functools
import importlib
import io
import os
import pickle
import select
import signal
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

from workers.handler import Agent, AgentError, StateLoadFailed, StateTooLarge

_STATE_FILE = ".notebook/namespace.pkl"
#: protocol 5 pickles ``bytearray`` (and out-of-band-capable buffers) without an intermediate copy, both
#: ways; protocol 4 (the default before 3.14) reduces a bytearray through a ``bytes`` copy of it
_PICKLE_PROTOCOL = 5
#: the probe's answer is one write of at most this many bytes (a pipe write up to PIPE_BUF is atomic)
_PROBE_MSG_BYTES = 4096
#: errors of writing the namespace file that mean "over a limit", not "broken"
_NO_ROOM = (errno.EFBIG, errno.ENOSPC, errno.EDQUOT)


class CellTimeout(Exception):
    pass


def _on_alarm(timeout_s: float, signum: int, frame: Any) -> None:
    raise CellTimeout(f"cell ran over CELL_TIMEOUT_S ({timeout_s:g} s)")


class Notebook(Agent):
    async def start(self, state: dict[str, Any] | None) -> None:
        self.ns: dict[str, Any] = {"__name__": "__notebook__"}
        state = state or {}
        self.cells = int(state.get("cells", 0))
        self.warning: str | None = None
        lost: list[str] = []
        limits = self.ctx.limits or {}
        path = self.ctx.workspace / _STATE_FILE
        if state and path.exists():
            # the probe and the real load share the start's time (the worker's turn timeout)
            problem = _probe_load(path, max(1.0, (float(limits.get("turnTimeoutS", 61)) - 1) / 2))
            if problem is None:
                problem = self._load(path)
            if problem is not None:
                lost.append(f"variables ({problem})")
        for name, module in (state.get("imports") or {}).items():
            try:
                self.ns[str(name)] = importlib.import_module(str(module))
            except Exception:  # noqa: BLE001
                lost.append(f"{name} (import {module})")
        lost += [str(n) for n in state.get("unrestorable") or []]
        if lost:
            self.warning = "not restored after resume (re-run their cells): " + ", ".join(lost)
        default = max(1.0, float(limits.get("turnTimeoutS", 61)) - 1)
        self.cell_timeout_s = float(self.ctx.env.get("CELL_TIMEOUT_S", default))

    def _run(self, source: str) -> dict[str, Any]:
        out, err = io.StringIO(), io.StringIO()
        result: dict[str, Any] = {"repr": None}
        try:
            tree = ast.parse(source, mode="exec")
        except SyntaxError as e:
            return {"stdout": "", "stderr": "", "repr": None, "error": f"SyntaxError: {e}"}
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        self.ns["print"] = functools.partial(builtins.print, file=out)  # the cell's own print
        old = signal.signal(signal.SIGALRM, functools.partial(_on_alarm, self.cell_timeout_s))
        signal.setitimer(signal.ITIMER_REAL, self.cell_timeout_s)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                exec(compile(tree, "<cell>", "exec"), self.ns)  # noqa: S102 - that is the agent
                if last is not None:
                    value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), self.ns)  # noqa: S307
                    result["repr"] = None if value is None else repr(value)
        except CellTimeout as e:
            result["error"] = f"TimeoutError: {e}"
        except MemoryError:
            result["error"] = "MemoryError: the cell went over the session's memory limit (isolation.maxMemory)"
        except Exception:  # noqa: BLE001 - a failing cell is an answer, not a crash
            result["error"] = traceback.format_exc(limit=5)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
            self.ns.pop("print", None)
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        result.update(stdout=out.getvalue(), stderr=err.getvalue())
        return result

    async def invoke(self, input: Any) -> Any:  # noqa: A002
        if not isinstance(input, str):
            raise AgentError("notebook input must be Python source (a string)")
        self.cells += 1
        result = self._run(input)  # in this (the host's main) thread: the alarm needs it
        if self.warning:
            result["warning"], self.warning = self.warning, None
        return result

    def _load(self, path: Path) -> str | None:
        """Unpickle the namespace file into ``self.ns`` (after the probe found it loads). Returns None,
        or ``"Type: message"`` if it raised an ordinary exception (nothing restored); raises
        ``StateLoadFailed`` for a ``BaseException`` that is not one (e.g. ``SystemExit``)."""
        try:
            with open(path, "rb") as f:
                self.ns.update(pickle.load(f))
        except Exception as e:  # noqa: BLE001 - an agent-written file: report, start empty
            return f"{e.__class__.__name__}: {e}"
        except BaseException as e:  # noqa: BLE001 - SystemExit & co. must not end the host
            raise StateLoadFailed(f"unpickling the notebook's variables ({_STATE_FILE}) raised "
                                  f"{e.__class__.__name__}", e.__class__.__name__) from None
        return None

    async def snapshot(self) -> dict[str, Any]:
        keep: dict[str, Any] = {}
        imports: dict[str, str] = {}
        skipped = []
        for k, v in self.ns.items():
            if k.startswith("__"):
                continue
            if isinstance(v, types.ModuleType):
                imports[k] = v.__name__
                continue
            if isinstance(v, (types.FunctionType, type)) and getattr(v, "__module__", None) == "__notebook__":
                skipped.append(k)  # defined in a cell: pickle would store a reference it cannot resolve
                continue
            keep[k] = v
        path = self.ctx.workspace / _STATE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        try:
            try:
                _write_pickle(tmp, keep)
            except _WriteError:
                raise
            except _PICKLING_ERRORS:  # some variable is unpicklable: find which, drop, write again
                for k, v in list(keep.items()):
                    try:
                        # to a sink: checking a variable must not hold a pickled copy of it in memory
                        pickle.Pickler(_Discard(), protocol=_PICKLE_PROTOCOL).dump(v)
                    except _PICKLING_ERRORS:  # unpicklable values are reported, not fatal
                        skipped.append(k)
                        del keep[k]
                _write_pickle(tmp, keep)
            os.replace(tmp, path)  # the previous file stays whole until the new one is complete
        except BaseException as e:  # MemoryError too: no half-written file is left in the workspace
            with contextlib.suppress(OSError):
                tmp.unlink()
            if isinstance(e, _WriteError) and e.errno in _NO_ROOM:
                disk = (self.ctx.limits or {}).get("diskBytes")
                # EFBIG is the file limit (maxDiskBytes); ENOSPC/EDQUOT may be the machine's disk as well,
                # which no `del` of the user's fixes alone (fresh-user round 15: a 14 MiB state on a full
                # disk was blamed on the 1 GiB limit)
                why = (f"isolation.maxDiskBytes is {disk} bytes per file and per workspace" if e.errno == errno.EFBIG
                       else f"the disk holding the workspace is full (or isolation.maxDiskBytes, {disk} bytes, "
                            "is reached)")
                raise StateTooLarge(
                    f"the notebook's variables do not fit in the workspace ({os.strerror(e.errno)} writing "
                    f"{_STATE_FILE}): {why}; the session keeps running with all its variables (free some, "
                    "e.g. `del name`, or space on the worker, and suspend again)") from None
            if isinstance(e, _WriteError):
                raise OSError(e.errno, f"writing {_STATE_FILE}: {os.strerror(e.errno)}") from None
            raise
        return {"cells": self.cells, "variables": sorted(keep), "imports": imports,
                "unrestorable": sorted(skipped), "unpicklable": sorted(skipped)}


#: what pickling one variable may raise without that ending the snapshot: any exception, and the
#: ``BaseException``s a ``__reduce__`` can raise to end the process (fresh-user run: ``raise SystemExit``
#: there killed the host mid-suspend and the session came back with no variables). Not
#: ``asyncio.CancelledError`` (the host's own cancellation); ``os._exit`` cannot be caught at all.
_PICKLING_ERRORS = (Exception, SystemExit, KeyboardInterrupt, GeneratorExit)


class _Discard:
    """A file that forgets what is written (a picklability check that keeps no copy)."""

    def write(self, b: Any) -> int:
        return len(b)


class _WriteError(Exception):
    """Writing the namespace file failed (``errno``), as opposed to pickling a variable failing (a
    variable's ``__reduce__`` may raise ``OSError`` too: that one only makes the variable unpicklable)."""

    def __init__(self, errno_: int) -> None:
        super().__init__(os.strerror(errno_))
        self.errno = errno_


class _FileSink:
    """Unbuffered writes to ``fd`` for the pickler (it frames and buffers itself, and hands a large
    buffer over whole); loops over short writes, and turns an ``OSError`` into ``_WriteError``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        done = 0
        while done < len(view):
            try:
                done += os.write(self.fd, view[done:])
            except OSError as e:
                raise _WriteError(e.errno or errno.EIO) from None
        return done


def _write_pickle(path: Path, obj: Any) -> None:
    """Pickle ``obj`` straight into ``path`` (protocol 5: large buffers are written, not copied).
    Raises ``_WriteError`` if the file cannot be created or written, whatever a variable raises else."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as e:
        raise _WriteError(e.errno or errno.EIO) from None
    try:
        pickle.Pickler(_FileSink(fd), protocol=_PICKLE_PROTOCOL).dump(obj)
    finally:
        os.close(fd)


def _probe_load(path: Path, timeout_s: float) -> str | None:
    """Unpickle ``path`` in a forked child and report how that went, without loading anything here.

    Returns None (it loads), or ``"Type: message"`` for an ordinary exception (the variables are then not
    restored, with a warning). Raises ``StateLoadFailed`` when the unpickling ended the child: a
    ``BaseException`` that is not an ``Exception`` (``SystemExit``...), an exit status of its own
    (``os._exit``), or a fatal signal other than SIGKILL (``abort``: SIGABRT). Raises ``RuntimeError``
    (an ordinary start failure, not blamed on the state) if the child was SIGKILLed (the memory limit or
    a kill from outside: not a sign about the state) or ran over ``timeout_s`` seconds (maybe just a
    loaded machine); a good snapshot must never be set aside for either."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the probe: load, say how it went in one atomic write, and leave without cleanup
        try:
            os.close(r)
            try:
                with open(path, "rb") as f:
                    pickle.load(f)
                msg = "ok"
            except Exception as e:  # noqa: BLE001
                msg = f"error {e.__class__.__name__}: {e}"
            except BaseException as e:  # noqa: BLE001
                msg = f"fatal {e.__class__.__name__}"
            os.write(w, msg.encode(errors="replace")[:_PROBE_MSG_BYTES])
        finally:
            os._exit(0)
    os.close(w)
    deadline = time.monotonic() + timeout_s
    msg = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise RuntimeError(f"loading the notebook's variables took over {timeout_s:g} s")
            if select.select([r], [], [], left)[0]:
                msg = os.read(r, _PROBE_MSG_BYTES)  # the whole message (one atomic write), or EOF
                break
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    text = msg.decode(errors="replace")
    if text == "ok":
        return None
    if text.startswith("error "):
        return text[len("error "):]
    what = f"unpickling the notebook's variables ({_STATE_FILE})"
    if text.startswith("fatal "):
        kind = text[len("fatal "):]
        raise StateLoadFailed(f"{what} raised {kind}", kind)
    if os.WIFEXITED(status):
        raise StateLoadFailed(f"{what} ended the process with exit status {os.WEXITSTATUS(status)}",
                              f"exit status {os.WEXITSTATUS(status)}")
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
    if sig and sig != signal.SIGKILL:
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        raise StateLoadFailed(f"{what} ended the process with signal {name}", f"signal {name}")
    raise RuntimeError(f"{what} was killed (status {status}); not taken as the state's fault")
