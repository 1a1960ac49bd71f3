"""``substrate keys create/revoke --file F``: a key file that cannot be read, parsed or written is one
line and exit 2, and is left as it was (fresh-user run: FileNotFoundError, IsADirectoryError, a YAML
ParserError and KeyError 'keys' were tracebacks). A good file still gets the key appended."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from substrate.cli import app


def _one_line(r) -> str:  # type: ignore[no-untyped-def]
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    return lines[0]


@pytest.mark.parametrize("case, says", [
    ("no folder", "does not exist"),
    ("a folder", "cannot"),
    ("bad yaml", "not valid YAML"),
    ("an object", "must hold a list of keys"),
    ("a list of strings", "must hold a list of keys"),
    ("a bad entry", "entry 0"),
])
@pytest.mark.parametrize("command", ["create", "revoke", "list"])
def test_a_bad_key_file_is_one_line_and_exit_2(tmp_path: Path, case: str, says: str, command: str) -> None:
    f = {"no folder": tmp_path / "missing" / "keys.yaml", "a folder": tmp_path}.get(case, tmp_path / "keys.yaml")
    body = {"bad yaml": "keys: [unclosed\n", "an object": "tenants: {a: 1}\n", "a list of strings": "- a\n- b\n",
            "a bad entry": "- {tenant: BAD, sha256: abc}\n"}
    if case in body:
        f.write_text(body[case])
    before = f.read_text() if f.is_file() else None
    argv = {"create": ["keys", "create", "team-a", "--file", str(f)],
            "revoke": ["keys", "revoke", "some-key", "--file", str(f)],
            "list": ["keys", "list", "--file", str(f)]}[command]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 2, r.output
    line = _one_line(r)
    assert line.startswith(f"error: key file {f}") and says in line, line
    assert (f.read_text() if f.is_file() else None) == before
    assert not (tmp_path / "missing").exists()


def test_a_good_key_file_gets_the_key_and_a_revoke_takes_it_out(tmp_path: Path) -> None:
    f = tmp_path / "keys.yaml"
    r = CliRunner().invoke(app, ["keys", "create", "team-a", "--name", "ci", "--file", str(f)])
    assert r.exit_code == 0, r.output
    entries = yaml.safe_load(f.read_text())
    assert [(e["tenant"], e["name"]) for e in entries] == [("team-a", "ci")]
    f.write_text(yaml.safe_dump({"keys": entries}))  # the {keys: [...]} form is read too
    r = CliRunner().invoke(app, ["keys", "revoke", "ci", "--file", str(f)])
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(f.read_text()) == []


@pytest.mark.parametrize("file", [False, True])
def test_a_bad_tenant_is_exit_2_before_redis_or_the_file_is_touched(tmp_path: Path, monkeypatch, file: bool) -> None:
    """``keys create BAD_T`` exits 2 like every other input error (to Redis it was exit 1), and nothing is
    read or written: no Redis is reachable here, and the key file is not made."""
    monkeypatch.setenv("SUBSTRATE_REDIS__URL", "redis://127.0.0.1:9/0")  # nothing listens: a read would fail
    f = tmp_path / "keys.yaml"
    r = CliRunner().invoke(app, ["keys", "create", "BAD_T", *(["--file", str(f)] if file else [])])
    assert r.exit_code == 2, r.output
    assert _one_line(r).startswith("error invalid_tenant")
    assert not f.exists()


def test_no_runtime_found_is_exit_2_and_says_where_the_embedded_redis_is_looked_for(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    monkeypatch.delenv("SUBSTRATE_REDIS_URL", raising=False)
    monkeypatch.delenv("SUBSTRATE_REDIS__URL", raising=False)
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path / "data"))
    r = CliRunner().invoke(app, ["keys", "list"])
    assert r.exit_code == 2, r.output
    line = _one_line(r)
    assert line.startswith("error: no runtime found") and str(tmp_path / "data") in line, line
    assert "SUBSTRATE_DATA_DIR" in line and "SUBSTRATE_REDIS_URL" in line, line


def test_two_keys_of_one_name_are_refused_in_a_file_and_by_create(tmp_path: Path) -> None:
    """A file key's name is its ID: two alike made ``keys revoke NAME`` take out one and leave the other
    working (fresh-user run). ``keys create --file`` refuses the second; a file that has them anyway is
    refused when read (at start-up too: ``load_key_file``), naming both entries."""
    from substrate.apikeys import load_key_file
    from substrate.errors import InvalidInput

    f = tmp_path / "keys.yaml"
    assert CliRunner().invoke(app, ["keys", "create", "team-x", "--name", "ci", "--file", str(f)]).exit_code == 0
    before = f.read_text()
    r = CliRunner().invoke(app, ["keys", "create", "ops", "--admin", "--name", "ci", "--file", str(f)])
    assert r.exit_code == 2 and "already has a key named ci" in _one_line(r), r.output
    assert f.read_text() == before, "nothing written"
    f.write_text("- {tenant: team-c, key: sk_aaaa_secret1secret1secret1, name: same}\n"
                 "- {tenant: team-d, key: sk_bbbb_secret2secret2secret2, name: same, admin: true}\n")
    with pytest.raises(InvalidInput) as e:
        load_key_file(f)
    assert "entry 1 (tenant 'team-d') has the same name 'same' as entry 0 (tenant 'team-c')" in e.value.message


def test_keys_list_reads_a_key_file_and_never_shows_a_key(tmp_path: Path) -> None:
    """Fresh-user run: ``keys list`` had no ``--file`` while ``create`` and ``revoke`` take one."""
    f = tmp_path / "keys.yaml"
    f.write_text("- {tenant: team-c, key: sk_aaaa_secret1secret1secret1, name: ci}\n"
                 "- {tenant: ops, sha256: " + "ab" * 32 + ", admin: true}\n")
    r = CliRunner().invoke(app, ["keys", "list", "--file", str(f)])
    assert r.exit_code == 0, r.output
    assert "ci" in r.output and "team-c" in r.output and "file-abababab" in r.output and "yes" in r.output
    assert "secret1" not in r.output
    # without a name, a key's ID is the <id> inside it, as at import; revoke --file takes that ID
    f.write_text("- {tenant: team-e, key: sk_cafe1234_secret3secret3secret3}\n")
    r = CliRunner().invoke(app, ["keys", "list", "--file", str(f)])
    assert r.exit_code == 0 and "cafe1234" in r.output and "file-" not in r.output, r.output
    r = CliRunner().invoke(app, ["keys", "revoke", "cafe1234", "--file", str(f)])
    assert r.exit_code == 0, r.output
    assert "cafe1234" not in f.read_text()


@pytest.mark.parametrize("name, says", [
    ("ci\tbot", "U+0009"),
    ("a\u202eevil", "U+202E"),
    ("a\u2028b", "U+2028"),
    ("ci\u200bbot", "U+200B"),
    ("\udca0nb", "not UTF-8"),  # an undecodable byte of the command line
    ("x" * 129, "at most 128 characters"),
    (" ci", "begin or end with a space"),
    ("sk_abc_def", "start with 'sk_'"),
])
@pytest.mark.parametrize("to_file", [True, False])
def test_a_bad_key_name_is_refused_before_anything_is_written(tmp_path: Path, name: str, says: str,
                                                              to_file: bool) -> None:
    """A key's name is a label in ``keys list`` and a file key's ID (fresh-user run: a tab, 300 characters
    and an ``sk_...`` name were all taken). Refused with exit 2 before any file or Redis is touched (without
    --file no runtime is looked for: the refusal comes first)."""
    f = tmp_path / "keys.yaml"
    argv = ["keys", "create", "team-a", "--name", name] + (["--file", str(f)] if to_file else [])
    r = CliRunner().invoke(app, argv, env={"SUBSTRATE_DATA_DIR": str(tmp_path / "none")})
    assert r.exit_code == 2, r.output
    assert "invalid_key_name" in r.output and says in r.output, r.output
    assert not f.exists()
    # the longest name, and one with spaces inside, are fine
    ok = ["keys", "create", "team-a", "--name", "ci bot " + "x" * 121, "--file", str(f)]
    assert CliRunner().invoke(app, ok).exit_code == 0
    assert yaml.safe_load(f.read_text())[0]["name"] == "ci bot " + "x" * 121


def test_a_key_file_entry_with_a_bad_name_is_refused_at_load(tmp_path: Path) -> None:
    from substrate.apikeys import load_key_file
    from substrate.errors import InvalidInput

    f = tmp_path / "keys.yaml"
    f.write_text('- {tenant: team-a, sha256: "' + "a" * 64 + '", name: "a\\tb"}\n')
    with pytest.raises(InvalidInput) as e:
        load_key_file(f)
    assert "entry 0 name" in e.value.message and "U+0009" in e.value.message


def test_parallel_creates_and_revokes_on_one_key_file_keep_every_other_entry(tmp_path: Path) -> None:
    """Fresh-user tester 50: ``keys create --file`` run 10 at once left 3 to 6 of the 10 entries, and a key
    already in the file was gone too (revoked at the next start). Each command now holds a lock on the
    folder for its read-change-write, and replaces the file atomically."""
    import os
    import subprocess
    import sys

    import yaml

    from tests.conftest import ROOT

    f = tmp_path / "keys.yaml"
    r = CliRunner().invoke(app, ["keys", "create", "team-base", "--name", "base", "--file", str(f)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["keys", "create", "team-gone", "--name", "gone", "--file", str(f)])
    assert r.exit_code == 0, r.output
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBSTRATE_")}
    cmd = [sys.executable, "-m", "substrate.cli", "keys"]
    procs = [subprocess.Popen([*cmd, "create", "team-c", "--name", f"n{i}", "--file", str(f)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(8)]
    procs.append(subprocess.Popen([*cmd, "revoke", "gone", "--file", str(f)], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for p in procs:
        out, errs = p.communicate(timeout=120)
        assert p.returncode == 0, errs
    names = sorted(e["name"] for e in yaml.safe_load(f.read_text()))
    assert names == sorted(["base", *(f"n{i}" for i in range(8))]), names
    assert (f.stat().st_mode & 0o777) == 0o600  # a new key file is its owner's only
    assert [p.name for p in tmp_path.iterdir()] == ["keys.yaml"]  # no temporary file left


@pytest.mark.parametrize("key_id", ["", "   "])
@pytest.mark.parametrize("with_file", [True, False])
def test_an_empty_key_id_to_revoke_is_bad_input_exit_2_and_changes_nothing(tmp_path: Path, key_id: str,
                                                                           with_file: bool) -> None:
    f = tmp_path / "keys.yaml"
    assert CliRunner().invoke(app, ["keys", "create", "team-a", "--name", "ci", "--file", str(f)]).exit_code == 0
    before = f.read_text()
    r = CliRunner().invoke(app, ["keys", "revoke", key_id, *(["--file", str(f)] if with_file else [])])
    assert r.exit_code == 2 and "KEY_ID is empty" in _one_line(r), r.output
    assert f.read_text() == before


@pytest.mark.parametrize("command", ["list", "revoke"])
def test_a_missing_key_file_is_said_not_read_as_empty(tmp_path: Path, command: str) -> None:
    """Fresh-user tester 53: ``keys list --file missing.yaml`` printed an empty table (exit 0), and ``revoke``
    said "no key x": a mistyped path looked like a file without keys. Nothing is made."""
    f = tmp_path / "missing.yaml"
    argv = ["keys", "list", "--file", str(f)] if command == "list" else ["keys", "revoke", "x", "--file", str(f)]
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 2 and "it does not exist" in _one_line(r), r.output
    assert not f.exists()


def test_the_hint_after_a_create_names_the_key_file_by_its_absolute_path(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["keys", "create", "team-a", "--file", "keys.yaml"])
    assert r.exit_code == 0 and f"SUBSTRATE_AUTH__API_KEYS_FILE={tmp_path / 'keys.yaml'}" in r.output, r.output


def test_keys_list_of_a_file_as_json_and_a_bad_output_is_exit_2(tmp_path: Path) -> None:
    """Fresh-user tester 52: ``keys list`` had no ``-o json`` (``sessions list`` has)."""
    import json

    f = tmp_path / "keys.yaml"
    assert CliRunner().invoke(app, ["keys", "create", "team-a", "--name", "ci", "--admin", "--file", str(f)]).exit_code == 0
    r = CliRunner().invoke(app, ["keys", "list", "--file", str(f), "-o", "json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [(x["id"], x["tenant"], x["admin"], x["name"], len(x["sha256"])) for x in rows] == [("ci", "team-a", True, "ci", 64)]
    r = CliRunner().invoke(app, ["keys", "list", "--file", str(f), "-o", "yaml"])
    assert r.exit_code == 2 and "none of table, json" in r.output
