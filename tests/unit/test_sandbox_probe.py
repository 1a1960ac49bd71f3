"""workers.sandbox.probe: the start-up trial sandbox says why it failed, and a slow one is not called broken."""

from __future__ import annotations

import os

from workers import sandbox


def _script(tmp_path, body: str) -> str:
    p = tmp_path / "fake-bwrap"
    p.write_text("#!/bin/sh\n" + body + "\n")
    os.chmod(p, 0o755)
    return str(p)


def test_no_bwrap_names_the_package():
    why = sandbox.probe(None, None)
    assert "bwrap not found" in why and "bubblewrap" in why


def test_a_probe_that_times_out_says_so_instead_of_blaming_the_install(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "PROBE_TIMEOUT_S", 0.2)
    why = sandbox.probe(_script(tmp_path, "sleep 5"), None)
    assert "did not finish a trial sandbox" in why and "within 0.2 s" in why
    assert "install" not in why


def test_a_failing_bwrap_reports_its_stderr(tmp_path):
    why = sandbox.probe(_script(tmp_path, "echo 'no user namespaces' >&2; exit 1"), None)
    assert "no user namespaces" in why and "user.max_user_namespaces" in why


def test_a_working_bwrap_passes(tmp_path):
    assert sandbox.probe(_script(tmp_path, "exit 0"), None) is None
