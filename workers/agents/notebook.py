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
* state: the namespace's picklable variables are pickled into the workspace file
  ``.notebook/namespace.pkl`` and unpickled here, inside the sandbox, never by the worker. Imported
  modules are recorded by name and imported again on resume; functions and classes defined in cells
  cannot be pickled by reference, so they (and any unpicklable variable) are named in ``warning``.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import importlib
import io
import pickle
import signal
import sys
import traceback
import types
from typing import Any

from workers.handler import Agent, AgentError

_STATE_FILE = ".notebook/namespace.pkl"


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
        path = self.ctx.workspace / _STATE_FILE
        if state and path.exists():
            try:
                self.ns.update(pickle.loads(path.read_bytes()))
            except Exception as e:  # noqa: BLE001 - an agent-written file: report, start empty
                lost.append(f"variables ({e.__class__.__name__}: {e})")
        for name, module in (state.get("imports") or {}).items():
            try:
                self.ns[str(name)] = importlib.import_module(str(module))
            except Exception:  # noqa: BLE001
                lost.append(f"{name} (import {module})")
        lost += [str(n) for n in state.get("unrestorable") or []]
        if lost:
            self.warning = "not restored after resume (re-run their cells): " + ", ".join(lost)
        limits = self.ctx.limits or {}
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
            try:
                pickle.dumps(v)
                keep[k] = v
            except Exception:  # noqa: BLE001 - unpicklable values are reported, not fatal
                skipped.append(k)
        path = self.ctx.workspace / _STATE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(keep))
        return {"cells": self.cells, "variables": sorted(keep), "imports": imports,
                "unrestorable": sorted(skipped), "unpicklable": sorted(skipped)}
