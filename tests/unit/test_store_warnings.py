"""A snapshot store that does not answer is one warning line that says why, not a traceback (fresh-user
run: ``SUBSTRATE_SNAPSHOT__STORE=s3`` with no credentials logged two tracebacks at start, and one at each
orphan sweep). An unexpected error keeps its traceback."""

from __future__ import annotations

from typing import Any

import pytest

import snapshot.state_manager as sm
from substrate.errors import StoreUnavailable


class _Sweeper:
    def __init__(self, error: Exception) -> None:
        self.error = error

    async def sweep_orphans(self) -> None:
        raise self.error


@pytest.mark.parametrize("error, one_line", [
    (StoreUnavailable("snapshot store unavailable during list of 'snapshots/': NoCredentialsError: "
                      "Unable to locate credentials"), True),
    (RuntimeError("a bug"), False),
])
async def test_a_failed_orphan_sweep_says_why_in_one_line(monkeypatch: pytest.MonkeyPatch, error: Exception,
                                                         one_line: bool) -> None:
    said: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
    monkeypatch.setattr(sm.log, "warning", lambda msg, *a, **kw: said.append((msg, a, kw)))
    await sm.StateManager._sweep_quietly(_Sweeper(error))  # type: ignore[arg-type]
    (msg, args, kw), = said
    if one_line:
        assert "NoCredentialsError: Unable to locate credentials" in msg % args and not kw.get("exc_info")
    else:
        assert kw.get("exc_info") is True
