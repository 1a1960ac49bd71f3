"""What a CLI command writes into ``os.environ`` in-process stays in its test (``tests/conftest.py``
``_restore_environ``): ``substrate router`` sets ``SUBSTRATE_ROLE=router``, and a runtime started by a
later test inherited it and came up without workers ("runtime not ready"). The two tests run in order."""

from __future__ import annotations

import os

from typer.testing import CliRunner

from substrate.cli import app

SECRET = "a-secret-only-this-test-sets-0123"


def test_router_writes_its_role_into_the_environment() -> None:
    # written directly, not with monkeypatch: only the autouse fixture may put them back
    os.environ.update({"SUBSTRATE_REDIS_URL": "redis://127.0.0.1:1/0", "SUBSTRATE_WORKER__INTERNAL_TOKEN": SECRET,
                       "SUBSTRATE_AUTH__API_KEYS_FILE": "/nonexistent.yaml"})  # stops before it serves
    r = CliRunner().invoke(app, ["router", "--files", "--port", "1"])
    assert r.exit_code == 2, r.output
    assert os.environ.get("SUBSTRATE_ROLE") == "router"  # what the next test (and its runtimes) must not see


def test_the_next_test_gets_the_environment_back() -> None:
    assert os.environ.get("SUBSTRATE_ROLE") != "router"
    assert os.environ.get("SUBSTRATE_WORKER__INTERNAL_TOKEN") != SECRET
    assert os.environ.get("SUBSTRATE_AUTH__API_KEYS_FILE") != "/nonexistent.yaml"
