"""The embedded Redis of ``substrate up``: persistent, private, restarted if it dies (issue 8, issue 7)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import redis

from substrate import embedded
from substrate.embedded import EmbeddedRedis


def _wait(pred, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_data_survives_a_stop_and_start_in_the_same_folder(tmp_path: Path) -> None:
    """Regression: the embedded Redis ran without persistence, so a restart forgot every session."""
    with EmbeddedRedis(tmp_path / "redis") as a:
        r = redis.Redis.from_url(a.url)
        r.hset("substrate:{s1}:session", mapping={"state": "SUSPENDED", "epoch": "4"})
    assert list((tmp_path / "redis").iterdir()), "an append-only file was written"
    # a clean stop leaves no pid file behind (it is for finding a Redis a killed runtime left: round 11)
    assert not (tmp_path / "redis" / "redis.pid").exists()
    with EmbeddedRedis(tmp_path / "redis") as b:
        assert redis.Redis.from_url(b.url).hgetall("substrate:{s1}:session") == {b"state": b"SUSPENDED", b"epoch": b"4"}
        assert b.url != a.url, "a new password each start"


def test_a_killed_server_is_restarted_with_its_data(tmp_path: Path) -> None:
    """Regression: a killed embedded Redis was never restarted (while /healthz stayed 200)."""
    with EmbeddedRedis(tmp_path / "redis", watch_interval_s=0.1) as e:
        r = redis.Redis.from_url(e.url, socket_timeout=1)
        r.set("k", "v")
        r.execute_command("BGREWRITEAOF")  # on disk now, not only in the once-a-second fsync window
        _wait(lambda: r.info("persistence")["aof_rewrite_in_progress"] == 0)
        os.kill(e.redis_pid, signal.SIGKILL)  # the server itself (its keeper exits with it)
        _wait(lambda: e.restarts == 1 and redis.Redis.from_url(e.url, socket_timeout=1).get("k") == b"v")
        assert e.last_exit == "killed by SIGKILL"  # the log names the signal (a tester read "code 1")


def test_it_needs_its_password_and_listens_on_loopback_only(tmp_path: Path) -> None:
    with EmbeddedRedis(None) as e:
        assert "@127.0.0.1:" in e.url and e.password in e.url
        assert e.password.isalnum(), "no leading - (redis-cli -u took one for an option: fresh-user round 24)"
        with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
            redis.Redis(host="127.0.0.1", port=e.port, socket_timeout=1).ping()
        assert redis.Redis.from_url(e.url).config_get("bind")["bind"] == "127.0.0.1"
        for pid in (e.proc.pid, e.redis_pid):  # neither the keeper's nor the server's command line
            assert str(e.password) not in open(f"/proc/{pid}/cmdline").read(), "not visible in ps"


def test_two_runtimes_never_share_one_data_folder(tmp_path: Path) -> None:
    """Regression (fresh-user run): two `substrate up` in one folder both served the same sessions from
    one append-only file. The second is refused with the holder's pid, and the first keeps serving."""
    with EmbeddedRedis(tmp_path / "redis") as a:
        with pytest.raises(RuntimeError, match=rf"in use by another runtime \(pid {os.getpid()}\)"):
            EmbeddedRedis(tmp_path / "redis").start()
        assert redis.Redis.from_url(a.url).ping()
    with EmbeddedRedis(tmp_path / "redis") as b:  # released on stop
        assert redis.Redis.from_url(b.url).ping()


def _die_but_a_holder(e: EmbeddedRedis) -> int:
    """What the kernel does to ``e``'s runtime killed by SIGKILL, with one of its workers (this process's
    extra copy of the hold pipe's write end) still suspending: returns that copy."""
    held = os.dup(e._hold[1])
    os.close(e._lock_fd)
    e._lock_fd = None
    os.kill(e.proc.pid, signal.SIGUSR1)  # the keeper's parent-death signal
    embedded._HOLD_FDS.remove(e._hold[1])
    for fd in e._hold:
        os.close(fd)
    e._hold = None
    return held


def test_the_redis_of_a_killed_runtime_serves_its_workers_until_they_are_gone(tmp_path: Path) -> None:
    """Fresh-user run 35: after `kill -9` of `substrate up`, the embedded Redis died with it, the workers'
    suspends on their way out failed, and their sessions came back from older snapshots. It now serves
    until the last process holding its hold pipe (a worker) is gone, then stops (flushing its file), and
    the next start waits for that rather than stopping it under the workers."""
    a = EmbeddedRedis(tmp_path / "redis", restart=False)
    a.start()
    held = _die_but_a_holder(a)
    time.sleep(0.5)
    r = redis.Redis.from_url(a.url, socket_timeout=2)
    assert r.set("k", "suspended by a worker after the runtime died")  # still served
    assert a.proc.poll() is None
    os.close(held)  # the last worker exits
    _wait(lambda: a.proc.poll() is not None and not Path(f"/proc/{a.redis_pid}").exists(), 15)
    with EmbeddedRedis(tmp_path / "redis") as b:
        assert redis.Redis.from_url(b.url).get("k") == b"suspended by a worker after the runtime died"
    a.stop()


def test_a_redis_left_by_a_killed_runtime_is_stopped_at_the_next_start(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (fresh-user run): after `kill -9` of `substrate up` its Redis kept serving the data
    folder, and the next start ran a second one on the same file. A worker that still holds it past
    ``LEFTOVER_WAIT_S`` no longer does: the next start stops it."""
    monkeypatch.setattr(embedded, "LEFTOVER_WAIT_S", 0.5)
    a = EmbeddedRedis(tmp_path / "redis", restart=False)
    a.start()
    orphan = a.redis_pid
    redis.Redis.from_url(a.url).set("k", "v")
    held = _die_but_a_holder(a)  # a worker that hangs
    try:
        with EmbeddedRedis(tmp_path / "redis") as b:
            _wait(lambda: a.proc.poll() is not None, 10)
            assert not Path(f"/proc/{orphan}").exists(), f"the orphan {orphan} was stopped"
            assert redis.Redis.from_url(b.url).get("k") == b"v", "its data carried over"
    finally:
        os.close(held)
    a.stop()


def test_the_url_shown_to_users_carries_no_password(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "redis") as a:
        assert a.password not in a.safe_url and str(a.port) in a.safe_url


def test_cli_commands_find_the_running_embedded_redis(tmp_path: Path) -> None:
    """Second fresh-user run: `substrate keys create` could not reach the embedded Redis (its password is
    not shown). A running runtime leaves its URL in a 0600 file in its data folder, removed at stop."""
    from substrate.embedded import url_file

    with EmbeddedRedis(tmp_path / "redis") as a:
        f = url_file(tmp_path / "redis")
        assert f.read_text().strip() == a.url and (f.stat().st_mode & 0o777) == 0o600
    assert not f.exists()


def _readable_by_nobody(path: Path) -> bool:
    """Whether uid/gid 65534 can read ``path`` (a real open as that user, via setpriv)."""
    import subprocess

    r = subprocess.run(["/usr/bin/setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                        "/bin/cat", str(path)], capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="reading as another user needs root to switch to it")
def test_the_append_only_file_is_not_readable_by_other_local_users() -> None:
    """Regression (fresh-user round 14): redis-server wrote its append-only files 0644 in 0755 folders, so
    any local user read the session records and the activation-token signing keys and minted worker
    tokens. A folder left 0755 by an older version is made private too."""
    import shutil
    import tempfile

    tmp_path = Path(tempfile.mkdtemp(prefix="substrate-private-", dir="/tmp"))  # enterable by every user
    tmp_path.chmod(0o755)
    try:
        _check_private(tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _check_private(tmp_path: Path) -> None:
    folder = tmp_path / "redis"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    with EmbeddedRedis(folder) as a:
        redis.Redis.from_url(a.url).hset("substrate:auth:signing", mapping={"k1": "secret-key-material"})
        r = redis.Redis.from_url(a.url)
        r.execute_command("BGREWRITEAOF")
        # the rewrite's temporary files come and go: the checks below look once it has ended
        _wait(lambda: r.info("persistence")["aof_rewrite_in_progress"] == 0
              and r.info("persistence")["aof_rewrite_scheduled"] == 0)
        files = [p for p in folder.rglob("*") if p.is_file() and p.suffix in (".aof", ".rdb", ".manifest")]
        assert files, "an append-only file was written"
        _wait(lambda: any(b"secret-key-material" in p.read_bytes() for p in files if p.exists()))
        assert folder.stat().st_mode & 0o777 == 0o700
        for p in files:
            assert not _readable_by_nobody(p), f"{p} is readable by another user"
            assert p.stat().st_mode & 0o077 == 0, oct(p.stat().st_mode)
