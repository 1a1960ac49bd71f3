"""An invalid ``SUBSTRATE_`` variable: `substrate up` exits 2 with one line naming it, before anything starts
(fresh-user run: a value meant as JSON that was not JSON, a bad tenant in the API keys, a Redis URL without a
scheme, a missing key file and a data folder that is a file each gave a traceback, some only after the API had
started; negative or zero sizes and grace periods were accepted). Also: an empty path variable means its
default, an address this machine does not have is not called a taken port, and the key commands say in one
line that Redis is unreachable."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import uvicorn
from pydantic import ValidationError
from typer.testing import CliRunner

from substrate.cli import app
from substrate.embedded import EmbeddedRedis
from substrate.settings import Settings


@pytest.fixture(autouse=True)
def _nothing_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A clean environment, and a loud failure instead of a runtime if a check lets a bad value through."""
    for k in list(os.environ):
        if k.upper().startswith("SUBSTRATE_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(tmp_path / "data"))

    def started(*_: object) -> None:
        raise AssertionError("the runtime started with an invalid setting")

    monkeypatch.setattr(EmbeddedRedis, "start", started)
    monkeypatch.setattr(uvicorn.Server, "run", started)


def _port() -> int:
    from substrate.netports import free_port

    return free_port()


def _up(*extra: str) -> object:
    return CliRunner().invoke(app, ["up", "--host", "127.0.0.1", "--port", str(_port()), *extra])


def _one_error_line(output: str) -> str:
    lines = [x for x in output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    assert "Traceback" not in output
    return lines[0]


@pytest.mark.parametrize("var, value, says", [
    ("SUBSTRATE_QUOTA__DEFAULT", "{bad", "not valid JSON"),
    ("SUBSTRATE_AUTH__API_KEYS", "garbage", "not valid JSON"),
    ("SUBSTRATE_AUTH__API_KEYS", '[{"tenant":"Bad Name","key":"sk_x"}]', "invalid tenant name 'Bad Name'"),
    ("SUBSTRATE_AUTH__API_KEYS", '[{"tenant":"team-a"}]', "needs `sha256`"),
    # fresh-user round 24: a bad sha256 was told it "needs `sha256` ... or `key`"
    ("SUBSTRATE_AUTH__API_KEYS", '[{"tenant":"team-a","sha256":"zz"}]', "has a `sha256` that is not 64 hex digits (2 characters)"),
    # fresh-user run: a key the API never looks up (not sk_...) closed the open API for good
    ("SUBSTRATE_AUTH__API_KEYS", '[{"tenant":"team-a","key":"short"}]', "must start with `sk_`"),
    # fresh-user round 10: `sk_` alone was taken (and a key anyone can guess)
    ("SUBSTRATE_AUTH__API_KEYS", '[{"tenant":"team-a","key":"sk_"}]', "is 3 characters: an API key needs at least 19"),
    ("SUBSTRATE_AUTH__API_KEYS", '[{"tenant":"team-a","key":"sk_a_b","sha256":"' + "0" * 64 + '"}]',
     "has both `sha256` and `key`"),
    ("SUBSTRATE_AUTH__OIDC_ISSUER", "not a url", "must be an http:// or https:// URL"),
    # fresh-user round 25: botocore's traceback and exit 3 at start
    ("SUBSTRATE_SNAPSHOT__ENDPOINT_URL", "127.0.0.1:26899", "endpoint_url must be an http:// or https:// URL"),
    # fresh-user run: every worker was declared dead over and over
    ("SUBSTRATE_WORKER__LEASE_S", "0.5", "must be at least twice SUBSTRATE_WORKER__HEARTBEAT_S"),
    # fresh-user run: workers crashed at start one a second, then every create waited 30 s for a 503
    ("SUBSTRATE_WORKER__HOST", "192.0.2.1", "not an address of this machine"),  # RFC 5737 TEST-NET-1
    ("SUBSTRATE_WORKER__HOST", "2001:db8::1", "not an address of this machine"),  # RFC 3849 documentation
    ("SUBSTRATE_WORKER__HOST", "no such host.invalid", "is not an IPv4 address, an IPv6 literal or a name"),
    ("SUBSTRATE_WORKER__PORT_RANGE", "29699-29610", "a port range is LO-HI with 1 <= LO <= HI <= 65535"),
    ("SUBSTRATE_WORKER__PORT_RANGE", "29610", "a port range is LO-HI"),
    ("SUBSTRATE_WORKER__PORT_RANGE", "0-10", "a port range is LO-HI"),
    ("SUBSTRATE_WORKER__PORT_RANGE", "+1-10", "a port range is LO-HI"),
    ("SUBSTRATE_REDIS_URL", "notaurl", "not a Redis URL"),
    ("SUBSTRATE_REDIS__URL", "http://127.0.0.1:6379", "not a Redis URL"),
    ("SUBSTRATE_REDIS_URL", "redis://127.0.0.1:notaport/0", "not a Redis URL"),
    ("SUBSTRATE_AUTH__API_KEYS_FILE", "/nonexistent.yaml", "cannot read API key file /nonexistent.yaml"),
    ("SUBSTRATE_WORKER__SHUTDOWN_GRACE_S", "-5", "greater than or equal to 0"),
    ("SUBSTRATE_API__MAX_BODY_BYTES", "0", "greater than 0"),
    # inf passed every gt=0 bound, then every worker died on it (the settings reach workers as JSON, where
    # inf is null) and was restarted once a second for ever
    ("SUBSTRATE_WORKER__LEASE_S", "inf", "finite number"),
    ("SUBSTRATE_API__PARK_TIMEOUT_S", "1e400", "finite number"),
    ("SUBSTRATE_POOL__SCALE_DOWN_DELAY_S", "nan", "finite number"),
    ("SUBSTRATE_API__HEADER_READ_TIMEOUT_S", "0", "greater than 0"),
    ("SUBSTRATE_QUOTA__TENANTS", '{"Bad Name": {"maxRunning": 1}}', "'Bad Name' is not a tenant name"),
    # 1e300 passed every bound, then Redis refused the EXPIRE made from it on every delete
    ("SUBSTRATE_AUDIT__DELETED_RETENTION_S", "1e300", "implausibly large"),
    ("SUBSTRATE_API__RETRY_AFTER_S", "99999999999999999999999", "implausibly large"),
    # a fresh-user run: 'x:' made keys 'x::{s1}:session'; a brace would be a Redis Cluster hash tag
    ("SUBSTRATE_REDIS__KEY_PREFIX", "fresh14x:", "not ending with ':'"),
    ("SUBSTRATE_REDIS__KEY_PREFIX", "a{b}", "is not a key prefix"),
    ("SUBSTRATE_REDIS__KEY_PREFIX", "", "is not a key prefix"),
    # a bucket S3 refuses was taken at start, then every suspend failed 503
    ("SUBSTRATE_SNAPSHOT__BUCKET", "w", "'w' is not an S3 bucket name"),
    ("SUBSTRATE_SNAPSHOT__BUCKET", "Agent_Snapshots", "is not an S3 bucket name"),
    ("SUBSTRATE_SNAPSHOT__BUCKET", "a..b", "is not an S3 bucket name"),
    ("SUBSTRATE_SNAPSHOT__BUCKET", "-agent", "is not an S3 bucket name"),
    ("SUBSTRATE_REDIS__KEY_PREFIX", "x" * 65, "1-64 letters"),
    # a fresh-user run: redis-py reads a database that is not a number as 0 (it wrote into a shared db 0)
    ("SUBSTRATE_REDIS_URL", "redis://127.0.0.1:6379/abc", "database 'abc' is not a number"),
    ("SUBSTRATE_REDIS__URL", "redis://127.0.0.1:6379?db=x1", "database 'x1' is not a number"),
    ("SUBSTRATE_REDIS__URL", "unix:///tmp/r.sock?db=abc", "database 'abc' is not a number"),
    ("SUBSTRATE_LOG_LEVEL", "loud", "'loud' is not a log level"),
    ("SUBSTRATE_WORKER__IDEMPOTENCY_KEYS", "0", "greater than or equal to 1"),
    ("SUBSTRATE_API__ALLOWED_HOSTS", '["bad host"]', "'bad host' is not a host name"),
    ("SUBSTRATE_API__ALLOWED_HOSTS", '["example.com:8080"]', "without a port"),
    # a fresh-user run: a typo inside a JSON value named SUBSTRATE_QUOTA__DEFAULT__MAXRUNING, which nobody set
    ("SUBSTRATE_QUOTA__DEFAULT", '{"maxRuning":3}',
     "SUBSTRATE_QUOTA__DEFAULT: field 'maxRuning' is not allowed (did you mean 'maxRunning'?)"),
    ("SUBSTRATE_QUOTA", '{"default":{"maxTotl":3}}',
     "SUBSTRATE_QUOTA: field 'default.maxTotl' is not allowed (did you mean 'default.maxTotal'?)"),
    ("SUBSTRATE_QUOTA__TENANTS", '{"team-a":{"xyz":1}}',
     "field 'team-a.xyz' is not allowed (its fields: maxRunning, maxTotal, maxGpus, maxCreatesPerMinute)"),
    ("SUBSTRATE_QUOTA__DEFAULT", '{"maxRunning":-1}',
     "SUBSTRATE_QUOTA__DEFAULT: field 'maxRunning': Input should be greater than or equal to 0"),
    ("SUBSTRATE_AUTH__API_KEYS", '[{"tenant":"Bad Name","key":"sk_x"}]', "SUBSTRATE_AUTH__API_KEYS: field '[0].tenant'"),
    # fresh-user round 9: an unknown field of a key was ignored (admn: the admin right silently gone), the
    # string "yes" was read as admin: true, and a key given twice kept only its first tenant
    ("SUBSTRATE_AUTH__API_KEYS", '[{"tenant":"a","key":"sk_x_1234567890abcdef","admn":true}]',
     "field '[0].admn' is not allowed (did you mean '[0].admin'?)"),
    ("SUBSTRATE_AUTH__API_KEYS", '[{"tenant":"a","key":"sk_x_1234567890abcdef","admin":"yes"}]',
     "field '[0].admin': Input should be a valid boolean"),
    ("SUBSTRATE_AUTH__API_KEYS", '[{"tenant":"a","key":"sk_x_1234567890abcdef"},{"tenant":"b","key":"sk_x_1234567890abcdef"}]',
     "entry 1 (tenant 'b') gives the same key as entry 0 (tenant 'a')"),
    ("SUBSTRATE_AUTH__API_KEYS", '[{"tenant":"a","key":"sk_x_1234567890abcdef"},'
     '{"tenant":"a","sha256":"AD9277209DEFEBDD60BD03CBC1ED698666BBAE919D6418284783B464576E82F1"}]',
     "entry 1 (tenant 'a') gives the same key as entry 0 (tenant 'a')"),  # by its hash, in any case
    # fresh-user tester 47: a back-off whose maximum is below its start was taken
    ("SUBSTRATE_POOL__RESTART_BACKOFF_MAX_S", "0.1",
     "(0.1) must be at least SUBSTRATE_POOL__RESTART_BACKOFF_S (0.5)"),
    ("SUBSTRATE_KUBERNETES__FAILURE_BACKOFF_MAX_S", "0.5",
     "(0.5) must be at least SUBSTRATE_KUBERNETES__FAILURE_BACKOFF_S (1)"),
    # the nested form of the same typo: one error line (the warning "is ignored" would contradict it)
    ("SUBSTRATE_QUOTA__DEFAULT__MAXRUNING", "3",
     "SUBSTRATE_QUOTA__DEFAULT__MAXRUNING: not a setting (did you mean SUBSTRATE_QUOTA__DEFAULT__MAXRUNNING?)"),
])
def test_an_invalid_variable_is_one_line_and_exit_2(var: str, value: str, says: str,
                                                    monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(var, value)
    r = _up()
    assert r.exit_code == 2, r.output
    line = _one_error_line(r.output)
    assert line.startswith(f"error: {var}") and says in line, line
    assert not (tmp_path / "data").exists()  # nothing was started or created


def test_with_a_group_and_its_field_both_set_the_typo_is_blamed_on_the_one_that_holds_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh-user round 8: the typo was in SUBSTRATE_QUOTA's JSON, the line named SUBSTRATE_QUOTA__DEFAULT."""
    monkeypatch.setenv("SUBSTRATE_QUOTA__DEFAULT", '{"maxRunning":1}')
    monkeypatch.setenv("SUBSTRATE_QUOTA", '{"default":{"maxRunning":1,"maxRuning":2}}')
    r = _up()
    assert r.exit_code == 2, r.output
    assert _one_error_line(r.output) == ("error: SUBSTRATE_QUOTA: field 'default.maxRuning' is not allowed (did you "
                                         "mean 'default.maxRunning'?)")


@pytest.mark.parametrize("var", ["SUBSTRATE_DATA_DIR", "SUBSTRATE_WORKER__ROOT_DIR", "SUBSTRATE_SNAPSHOT__LOCAL_DIR"])
def test_a_folder_that_is_a_file_is_one_line_and_exit_2(var: str, monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv(var, str(tmp_path / "a-file"))
    r = _up()
    assert r.exit_code == 2, r.output
    line = _one_error_line(r.output)
    assert line.startswith(f"error: {var}: {tmp_path / 'a-file'} is not a folder"), line


@pytest.mark.parametrize("file, env, says", [
    ("- {tenant: team-x, key: sk_abc_secret1234567890, nmae: foo}\n", None, "entry 0 nmae: not a field of a key (did you mean 'name'?)"),
    ("- {tenant: team-x, key: sk_abc_secret1234567890, admin: true}\n- {tenant: team-z, key: sk_abc_secret1234567890}\n", None,
     "entry 1 (tenant 'team-z') gives the same key as entry 0 (tenant 'team-x')"),
    # round 10: a key written twice in one entry kept the last one, unasked
    ("- tenant: team-x\n  key: sk_abc_secret1234567890\n  key: sk_abc_secret1234567899\n", None,
     "key 'key' at line 3, column 3 appears twice in one mapping (first at line 2, column 3)"),
    ("- tenant: team-x\n  key: sk_\n", None, "is 3 characters: an API key needs at least 19"),
    # a fresh-user run: an empty file said "must hold a list of keys" while `keys create --file` took it
    ("", None, "is empty: with no key the API would be open to anyone; add one with `substrate keys create"),
    ("# keys\n", None, "is empty"),
    ("- {tenant: team-x, key: sk_abc_secret1234567890}\n", '[{"tenant":"team-b","key":"sk_abc_secret1234567890"}]',
     "(tenant 'team-x') gives the same key as SUBSTRATE_AUTH__API_KEYS entry 0 (tenant 'team-b')"),
])
def test_a_key_file_with_an_unknown_field_or_a_key_given_twice_is_refused(
        file: str, env: str | None, says: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fresh-user round 9: both started, one with a key's admin right gone, one with a key's second tenant
    dropped."""
    (tmp_path / "keys.yaml").write_text(file)
    monkeypatch.setenv("SUBSTRATE_AUTH__API_KEYS_FILE", str(tmp_path / "keys.yaml"))
    if env:
        monkeypatch.setenv("SUBSTRATE_AUTH__API_KEYS", env)
    r = _up()
    assert r.exit_code == 2, r.output
    line = _one_error_line(r.output)
    assert line.startswith("error: SUBSTRATE_AUTH__API_KEYS_FILE: ") and says in line and "secret1234567890" not in line, line


def test_a_valid_api_key_file_and_keys_pass_the_checks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "keys.yaml").write_text("- {tenant: team-a, sha256: " + "ab" * 32 + "}\n")
    monkeypatch.setenv("SUBSTRATE_AUTH__API_KEYS_FILE", str(tmp_path / "keys.yaml"))
    monkeypatch.setenv("SUBSTRATE_AUTH__API_KEYS", '[{"tenant":"team-b","key":"sk_x_y234567890abcdef"}]')
    r = _up()
    assert isinstance(r.exception, AssertionError)  # got as far as starting the embedded Redis


def test_the_router_checks_the_key_file_before_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBSTRATE_REDIS_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("SUBSTRATE_WORKER__INTERNAL_TOKEN", "a-secret-of-its-own-0123")
    monkeypatch.setenv("SUBSTRATE_AUTH__API_KEYS_FILE", "/nonexistent.yaml")
    r = CliRunner().invoke(app, ["router", "--files", "--port", str(_port())])
    assert r.exit_code == 2, r.output
    assert _one_error_line(r.output).startswith("error: SUBSTRATE_AUTH__API_KEYS_FILE")


@pytest.mark.parametrize("argv", [["controller"], ["worker", "--pool", "default", "--slots", "1"]])
def test_the_other_runtime_commands_refuse_an_invalid_variable(argv: list[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBSTRATE_QUOTA__DEFAULT", "{bad")
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 2, r.output
    assert _one_error_line(r.output).startswith("error: SUBSTRATE_QUOTA__DEFAULT: not valid JSON")


def test_obviously_bounded_settings_have_bounds() -> None:
    for section, field, value in [("worker", "shutdown_grace_s", -5), ("api", "max_body_bytes", 0),
                                  ("api", "port", 0), ("worker", "heartbeat_s", 0), ("snapshot", "retention", 0),
                                  ("state", "scan_interval_s", -1), ("audit", "max_per_session", 0)]:
        with pytest.raises(ValidationError, match=field):
            Settings(**{section: {field: value}})
    # zero stays allowed where it means "none" or "at once"
    s = Settings(api={"slot_wait_s": 0, "max_parked": 0}, worker={"prestart_hosts": 0, "shutdown_grace_s": 0})
    assert s.api.slot_wait_s == 0 and s.worker.prestart_hosts == 0


@pytest.mark.parametrize("var", ["SUBSTRATE_DATA_DIR", "SUBSTRATE_REDIS__DATA_DIR", "SUBSTRATE_WORKER__ROOT_DIR",
                                 "SUBSTRATE_SNAPSHOT__LOCAL_DIR", "SUBSTRATE_AUTH__API_KEYS_FILE"])
def test_an_empty_path_variable_means_its_default(var: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``SUBSTRATE_DATA_DIR=`` was the current folder: redis/, workers/ and snapshots/ were created in it."""
    monkeypatch.delenv("SUBSTRATE_DATA_DIR")
    monkeypatch.setenv(var, "")
    s = Settings()
    assert s.data_dir == Path("var")
    assert (s.redis.data_dir, s.worker.root_dir, s.snapshot.local_dir) == \
        (Path("var/redis"), Path("var/workers"), Path("var/snapshots"))
    assert s.auth.api_keys_file is None


def test_an_address_of_another_machine_is_not_called_a_taken_port() -> None:
    r = CliRunner().invoke(app, ["up", "--host", "192.0.2.1", "--port", str(_port())])  # TEST-NET-1: never ours
    assert r.exit_code == 2, r.output
    line = _one_error_line(r.output)
    assert "192.0.2.1 is not an address of this machine" in line and "--host" in line
    assert "another `substrate up`" not in line


def test_a_taken_port_still_says_so() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = CliRunner().invoke(app, ["up", "--host", "127.0.0.1", "--port", str(s.getsockname()[1])])
    assert r.exit_code == 2, r.output
    assert "another `substrate up`? choose one with --port" in _one_error_line(r.output)


@pytest.mark.parametrize("argv", [["keys", "list"], ["keys", "create", "team-a"], ["keys", "revoke", "k1"],
                                  ["keys", "rotate-signing"]])
def test_the_key_commands_say_in_one_line_that_redis_is_unreachable(argv: list[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBSTRATE_REDIS_URL", f"redis://127.0.0.1:{_port()}/0")  # nothing listens there
    r = CliRunner().invoke(app, argv)
    assert r.exit_code == 1, r.output
    assert _one_error_line(r.output).startswith("error: Redis unreachable")


def test_a_data_folder_that_cannot_be_created_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc is "writable" to root by os.access, but refuses folders: that was a FileNotFoundError traceback."""
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", "/proc/substrate-test/data")
    r = _up()
    assert r.exit_code == 2, r.output
    line = _one_error_line(r.output)
    assert line.startswith("error: SUBSTRATE_DATA_DIR: ") and "/proc" in line, line
    if os.geteuid() == 0:  # as anyone else, /proc is "not writable" before any mkdir is tried
        assert "cannot create /proc/substrate-test/data" in line, line


@pytest.mark.parametrize("content, says", [
    ("- {tenant: BAD, sha256: abc}\n", "entry 0"),
    ("keys: [unclosed\n", "is not valid YAML at line"),
])
def test_a_bad_key_file_is_one_line(content: str, says: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Pydantic's and PyYAML's messages span lines (with a link): `up` said them over three lines."""
    (tmp_path / "keys.yaml").write_text(content)
    monkeypatch.setenv("SUBSTRATE_AUTH__API_KEYS_FILE", str(tmp_path / "keys.yaml"))
    r = _up()
    assert r.exit_code == 2, r.output
    line = _one_error_line(r.output)
    assert line.startswith("error: SUBSTRATE_AUTH__API_KEYS_FILE: ") and says in line, line


def test_a_heartbeat_the_default_lease_cannot_outlive_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The default lease (5 s) is checked against a heartbeat set alone (fresh-user run: lease 0.5 s,
    heartbeat 5 s had every worker declared dead over and over)."""
    monkeypatch.setenv("SUBSTRATE_WORKER__HEARTBEAT_S", "5")
    r = _up()
    assert r.exit_code == 2, r.output
    line = _one_error_line(r.output)
    assert line.startswith("error: SUBSTRATE_WORKER__LEASE_S: (5) must be at least twice SUBSTRATE_WORKER__HEARTBEAT_S (5)"), line


def test_a_template_warning_is_not_repeated_by_the_start_up_check_or_the_workers(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fresh-user run: an unknown template field was warned about three times at start (the CLI's check,
    the runtime's load, each worker's). The check before start and the workers' read keep their
    warnings to themselves: the runtime's own load logs them, once."""
    from workers.server import pool_opts_out_of_sandbox

    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "t.yaml").write_text(
        "apiVersion: substrate.agent.dev/v1\nkind: WorkerPool\nmetadata: {name: default}\nspec: {slots: 2}\n---\n"
        "apiVersion: substrate.agent.dev/v1\nkind: ActorTemplate\nmetadata: {name: counter}\n"
        "spec: {entrypoint: 'workers.agents.counter:Counter', snapshotIntervl: 30s}\n")
    import substrate.specs as specs
    from substrate.settings import Settings

    logged: list[str] = []  # the specs logger's warnings (caplog misses them once `up` set logging up)
    monkeypatch.setattr(specs.log, "warning", lambda msg, *a, **kw: logged.append(str(msg)))
    cat = specs.load_catalog(cfg)  # the runtime's load: logged there
    assert any("snapshotIntervl" in w for w in cat.warnings) and any("snapshotIntervl" in m for m in logged)
    logged.clear()
    monkeypatch.setenv("SUBSTRATE_CONFIG_DIR", str(cfg))
    pool_opts_out_of_sandbox(Settings(), "default")  # each worker's read
    r = _up("--config", str(cfg))
    assert isinstance(r.exception, AssertionError), r.output  # got as far as starting the embedded Redis
    assert not any("snapshotIntervl" in m for m in logged) and "snapshotIntervl" not in r.output, logged


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder of another user needs root")
@pytest.mark.parametrize("sub, var", [("snapshots", "SUBSTRATE_DATA_DIR"), ("redis", "SUBSTRATE_DATA_DIR"),
                                      ("workers", "SUBSTRATE_DATA_DIR")])
def test_a_runtime_folder_another_user_made_is_refused(sub: str, var: str, monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    """Fresh-user round 17: in a world-writable data folder (a tmpfs root is 1777) another user made
    ``snapshots/`` before the runtime's first snapshot; the runtime wrote into it, and that user moved every
    committed snapshot of a session away (the session came back empty)."""
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o1777)
    (data / sub).mkdir()
    os.chown(data / sub, 65534, 65534)
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(data))
    r = _up()
    assert r.exit_code == 2, r.output
    line = _one_error_line(r.output)
    assert line.startswith(f"error: {var}: {data / sub} is owned by uid 65534, not this user"), line


def test_a_data_folder_every_user_can_write_in_without_the_sticky_bit_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                                                  tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o777)
    monkeypatch.setenv("SUBSTRATE_DATA_DIR", str(data))
    r = _up()
    assert r.exit_code == 2, r.output
    assert "is writable by every user" in _one_error_line(r.output)
