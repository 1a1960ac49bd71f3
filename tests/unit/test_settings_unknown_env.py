"""An unknown ``SUBSTRATE_`` variable is named with the closest known one (fresh-user run: ``SUBSTRATE_API__PORTT=1
substrate up`` started on 8080 without a word). A warning, not an exit: other tools may read such names."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from substrate.cli import app
from substrate.settings import unknown_env, unknown_json_fields


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.upper().startswith("SUBSTRATE_"):
            monkeypatch.delenv(k)


def test_a_typo_is_named_with_the_closest_setting() -> None:
    assert unknown_env({"SUBSTRATE_API__PORTT": "1", "SUBSTRATE_LOG_LEVL": "x", "SUBSTRATE_REDIS__DATADIR": "d",
                        "SUBSTRATE_API_PORT": "1", "SUBSTRATE_FROBNICATE": "1"}) == [
        ("SUBSTRATE_API_PORT", "SUBSTRATE_API__PORT"), ("SUBSTRATE_API__PORTT", "SUBSTRATE_API__PORT"),
        ("SUBSTRATE_FROBNICATE", None), ("SUBSTRATE_LOG_LEVL", "SUBSTRATE_LOG_LEVEL"),
        ("SUBSTRATE_REDIS__DATADIR", "SUBSTRATE_REDIS__DATA_DIR")]


def test_settings_and_variables_read_elsewhere_are_known() -> None:
    assert unknown_env({
        "SUBSTRATE_API__PORT": "1", "substrate_api__port": "1",  # pydantic-settings ignores case
        "SUBSTRATE_DATA_DIR": "d", "SUBSTRATE_REDIS__DATA_DIR": "d", "SUBSTRATE_QUOTA__DEFAULT__MAXRUNNING": "3",
        "SUBSTRATE_QUOTA__TENANTS": "{}", "SUBSTRATE_QUOTA__TENANTS__ACME": "{}", "SUBSTRATE_REDIS": "{}",
        "SUBSTRATE_REDIS_URL": "redis://x", "SUBSTRATE_SERVER": "http://x", "SUBSTRATE_TOKEN": "sk_x",
        "SUBSTRATE_WORKER_POOL": "p", "SUBSTRATE_POD_IP": "1.2.3.4", "SUBSTRATE_LIFELINE_FD": "3",
        "PATH": "/bin", "SUBSTRATEX": "1"}) == []


def test_a_field_a_group_has_not_in_its_json_value_is_named() -> None:
    """A group's JSON value ignores fields it does not have: ``SUBSTRATE_QUOTA='{"defualt": ...}'`` started
    with no quota and no word (fresh-user round 6)."""
    assert unknown_json_fields({
        "SUBSTRATE_QUOTA": '{"defualt": {"maxRunning": 3}, "default": {"maxRunning": 2}}',
        "substrate_api": '{"prot": 3, "port": 1}',  # as spelt
        "SUBSTRATE_WORKER__SANDBOX": "not json", "SUBSTRATE_REDIS": "[1]",  # not objects: an error, or nothing
        "SUBSTRATE_POOL": '{"scale_down_delay_s": 1, "frobnicate": true}'}) == [
        ("SUBSTRATE_POOL", "frobnicate", None), ("SUBSTRATE_QUOTA", "defualt", "default"),
        ("substrate_api", "prot", "port")]
    assert unknown_json_fields({"SUBSTRATE_QUOTA": '{"default": {"maxRunning": 2}}', "SUBSTRATE_API": "{}"}) == []


def test_up_warns_and_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("SUBSTRATE_API__PORTT", "1")
    monkeypatch.setenv("SUBSTRATE_QUOTA", '{"defualt": {"maxRunning": 3}}')
    with socket.socket() as s:  # a taken port: `up` stops there, after the warning, before anything starts
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = CliRunner().invoke(app, ["up", "--host", "127.0.0.1", "--port", str(port)])
    assert r.exit_code == 2, r.output
    assert "warning: SUBSTRATE_API__PORTT is not a substrate setting and is ignored; did you mean " \
           "SUBSTRATE_API__PORT?" in r.output
    assert "warning: SUBSTRATE_QUOTA: field 'defualt' is not a setting and is ignored; did you mean 'default'?" \
        in r.output
    assert f"127.0.0.1:{port}" in r.output  # it went on to the port check
    assert r.output.count("warning") == 2  # SUBSTRATE_DATA_DIR is known


def test_router_warns_before_its_own_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBSTRATE_REDIS__URLL", "redis://127.0.0.1:1/0")
    r = CliRunner().invoke(app, ["router"])
    assert r.exit_code == 2, r.output
    assert "SUBSTRATE_REDIS__URLL is not a substrate setting and is ignored; did you mean SUBSTRATE_REDIS__URL?" \
        in r.output
