"""Every CLI command's usage line names its arguments in capitals, as the README does (``ID``, ``INPUT``), not
with the Python parameter's name (``{sid}``, a fresh-user finding carried over several sessions)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from substrate.cli import app


@pytest.mark.parametrize("command,names", [
    (["sessions", "get"], ["ID"]),
    (["sessions", "invoke"], ["ID", "INPUT"]),
    (["sessions", "suspend"], ["ID"]),
    (["sessions", "resume"], ["ID"]),
    (["sessions", "events"], ["ID"]),
    (["sessions", "delete"], ["ID"]),
    (["sessions", "create"], ["TEMPLATE"]),
    (["keys", "create"], ["TENANT"]),
    (["keys", "revoke"], ["KEY_ID"]),
    (["convert"], ["FILES"]),
])
def test_the_usage_line_names_each_argument_in_capitals(command: list[str], names: list[str]) -> None:
    r = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    usage = next(line for line in r.output.splitlines() if "Usage:" in line)
    for name in names:
        assert name in usage, usage
    assert not any(ch.islower() for part in usage.split("[OPTIONS]")[1].split() for ch in part.strip("{}[].")), usage
