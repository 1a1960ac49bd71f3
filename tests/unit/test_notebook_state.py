"""The notebook agent's state file, without a runtime: what a snapshot keeps, and how a load that ends
its process is told apart from one that raises."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from workers.agents.notebook import Notebook
from workers.handler import SessionContext, StateLoadFailed


def _notebook(ws: Path) -> Notebook:
    nb = Notebook(SessionContext(session_id="s", epoch=1, template="notebook", workspace=ws))
    asyncio.run(nb.start(None))
    return nb


def _resume(ws: Path, state: dict) -> dict:
    nb = Notebook(SessionContext(session_id="s", epoch=2, template="notebook", workspace=ws))
    asyncio.run(nb.start(state))
    return asyncio.run(nb.invoke("sorted(k for k in globals() if not k.startswith('__'))"))


def test_a_variable_whose_pickling_raises_oserror_is_skipped_not_fatal(tmp_path: Path) -> None:
    nb = _notebook(tmp_path)
    asyncio.run(nb.invoke("class Bad:\n    def __reduce__(self):\n        raise OSError(28, 'no')\n"
                          "b = Bad()\nxs = [1, 2]"))
    state = asyncio.run(nb.snapshot())
    assert state["variables"] == ["xs"] and "b" in state["unpicklable"]
    assert not list((tmp_path / ".notebook").glob("*.tmp")), "no half-written file is left"
    assert "xs" in _resume(tmp_path, state)["repr"]


@pytest.mark.parametrize(("cell", "kind"), [
    ("import os\nclass P:\n    def __reduce__(self):\n        return (os._exit, (3,))\np = P()", "exit status 3"),
    ("class P:\n    def __reduce__(self):\n        return (exec, ('raise KeyboardInterrupt',))\np = P()",
     "KeyboardInterrupt"),
])
def test_a_load_that_ends_the_process_is_state_load_failed(tmp_path: Path, cell: str, kind: str) -> None:
    nb = _notebook(tmp_path)
    asyncio.run(nb.invoke(cell))
    state = asyncio.run(nb.snapshot())
    with pytest.raises(StateLoadFailed) as err:
        _resume(tmp_path, state)
    assert err.value.exception_type == kind


def test_a_load_that_raises_is_reported_in_the_warning_as_before(tmp_path: Path) -> None:
    nb = _notebook(tmp_path)
    asyncio.run(nb.invoke("class P:\n    def __reduce__(self):\n        return (int, ('x',))\np = P()"))
    out = _resume(tmp_path, asyncio.run(nb.snapshot()))
    assert "ValueError" in out["warning"] and "not restored" in out["warning"]


@pytest.mark.parametrize("exc", ["SystemExit(5)", "KeyboardInterrupt()", "GeneratorExit()"])
def test_a_variable_whose_pickling_ends_the_process_is_skipped_and_the_rest_kept(tmp_path: Path, exc: str) -> None:
    """Fresh-user run: ``raise SystemExit`` in a ``__reduce__`` killed the host mid-suspend (202, every
    variable gone); now only that variable is left out, as an unpicklable one."""
    nb = _notebook(tmp_path)
    asyncio.run(nb.invoke(f"x = 7\nclass P:\n    def __reduce__(self):\n        raise {exc}\np = P()"))
    state = asyncio.run(nb.snapshot())
    assert state["variables"] == ["x"] and "p" in state["unpicklable"]
    assert "'x'" in _resume(tmp_path, state)["repr"]
