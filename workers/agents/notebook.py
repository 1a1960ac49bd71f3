"""The notebook agent: runs Python cells; variables persist across turns and across suspend/resume.

Input is Python source. Output: ``stdout``, ``stderr``, ``repr`` of the last expression (or None) and
``error`` (a traceback string) if the cell raised. State: the cell namespace's picklable variables
(pickled into the workspace file ``.notebook/namespace.pkl`` at snapshot time) plus the cell history.
Cells run in a thread so a long cell does not block the worker's event loop; this is an example agent,
not a sandbox: isolation comes from the template's ``isolation`` (gVisor on Kubernetes).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import pickle
import traceback
import types
from typing import Any

from workers.handler import Agent, AgentError

_STATE_FILE = ".notebook/namespace.pkl"


class Notebook(Agent):
    async def start(self, state: dict[str, Any] | None) -> None:
        self.ns: dict[str, Any] = {"__name__": "__notebook__"}
        self.cells = int((state or {}).get("cells", 0))
        path = self.ctx.workspace / _STATE_FILE
        if state is not None and path.exists():
            self.ns.update(pickle.loads(path.read_bytes()))

    def _run(self, source: str) -> dict[str, Any]:
        out, err = io.StringIO(), io.StringIO()
        result: dict[str, Any] = {"repr": None}
        try:
            tree = ast.parse(source, mode="exec")
        except SyntaxError as e:
            return {"stdout": "", "stderr": "", "repr": None, "error": f"SyntaxError: {e}"}
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                exec(compile(tree, "<cell>", "exec"), self.ns)  # noqa: S102 - that is the agent
                if last is not None:
                    value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), self.ns)  # noqa: S307
                    result["repr"] = None if value is None else repr(value)
        except Exception:  # noqa: BLE001 - a failing cell is an answer, not a crash
            result["error"] = traceback.format_exc(limit=5)
        result.update(stdout=out.getvalue(), stderr=err.getvalue())
        return result

    async def invoke(self, input: Any) -> Any:  # noqa: A002
        if not isinstance(input, str):
            raise AgentError("notebook input must be Python source (a string)")
        self.cells += 1
        return await asyncio.to_thread(self._run, input)

    async def snapshot(self) -> dict[str, Any]:
        keep: dict[str, Any] = {}
        skipped = []
        for k, v in self.ns.items():
            if k.startswith("__") or isinstance(v, types.ModuleType):
                continue
            try:
                pickle.dumps(v)
                keep[k] = v
            except Exception:  # noqa: BLE001 - unpicklable values are reported, not fatal
                skipped.append(k)
        path = self.ctx.workspace / _STATE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(keep))
        return {"cells": self.cells, "variables": sorted(keep), "unpicklable": sorted(skipped)}
