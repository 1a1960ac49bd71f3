"""Unit tests of issue 7's pure parts: session env policy, isolation limits parsed at load, the sandbox's
command line (what is bound, what never is), and restore bounds."""

from __future__ import annotations

import asyncio
import os
import tempfile
import tarfile
from pathlib import Path

import pytest

from snapshot import archive
from substrate.envpolicy import check_session_env
from substrate.errors import InvalidInput, SnapshotCorrupt
from substrate.models import ActorTemplateSpec, Isolation
from substrate.specs import SpecError, load_documents
from substrate.settings import WorkerSettings
from workers.sandbox import Limits, SandboxPool, find_bwrap

#: the machine-wide uid locks (a pool kills what still runs as a uid it claims: a private lock folder
#: would let two test runs on one machine claim, and so kill, the same uid)
LOCK_DIR = WorkerSettings().sandbox_uid_lock_dir


def _unit_name() -> str:
    import uuid

    return f"unit-{uuid.uuid4().hex[:8]}"  # its cgroups are its own: closing a pool removes them


@pytest.mark.parametrize("name", ["LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONWARNINGS", "PATH",
                                  "HOME", "BROWSER", "BASH_ENV", "SUBSTRATE_X", "AWS_ACCESS_KEY_ID", "lower",
                                  "1ABC", "A-B", "A\n", "NODE_OPTIONS", "PERL5OPT", "RUBYOPT", "GCONV_PATH"])
def test_denied_names_are_refused_with_the_name(name):
    with pytest.raises(InvalidInput) as e:
        check_session_env({name: "x"})
    assert e.value.code == "invalid_env" and e.value.details["name"] == name and e.value.status == 422


def test_template_names_are_not_overridable_and_sizes_are_bounded():
    with pytest.raises(InvalidInput) as e:
        check_session_env({"MODEL": "x"}, ["MODEL"])
    assert e.value.details["name"] == "MODEL"
    # a template setting under a denied prefix is refused for being the template's (fresh-user review:
    # SHELL_TIMEOUT_S was said to be a variable "loaders, interpreters or the runtime act on")
    with pytest.raises(InvalidInput, match="the ActorTemplate sets this variable"):
        check_session_env({"SHELL_TIMEOUT_S": "1"}, ["SHELL_TIMEOUT_S"])
    with pytest.raises(InvalidInput):
        check_session_env({"BIG": "x" * 5000})
    with pytest.raises(InvalidInput):
        check_session_env({f"V{i}": "x" for i in range(65)})
    with pytest.raises(InvalidInput):
        check_session_env({f"V{i}": "x" * 4000 for i in range(9)})  # over the 32 KiB total
    with pytest.raises(InvalidInput):
        check_session_env({"S": "\ud800"})
    assert check_session_env({"MY_KEY": "v", "_X1": ""}) == {"MY_KEY": "v", "_X1": ""}


@pytest.mark.parametrize("iso,ok", [
    ({"maxMemory": "512Mi", "maxCpu": "500m", "maxDiskBytes": "2Gi"}, True),
    ({"maxMemory": "lots"}, False), ({"maxCpu": "-1"}, False), ({"maxDiskBytes": "1Zb"}, False),
    ({"maxProcesses": 0}, False), ({"network": "internet"}, False), ({"turnTimeout": "soon"}, False),
    ({"turnTimeout": "0"}, False), ({"network": "egress", "sandbox": False}, True),
    # plain numbers are quantities too, as in Kubernetes (a fresh-user run: "Input should be a valid string")
    ({"maxDiskBytes": 1073741824, "maxCpu": 2, "maxMemory": 268435456}, True), ({"maxCpu": 0.5}, True),
    ({"maxMemory": -5}, False), ({"maxCpu": True}, False),
    # below what a limit can mean (fresh-user round 8: maxMemory "0.5" truncated to 0 bytes, i.e. no limit)
    ({"maxMemory": "0.5"}, False), ({"maxMemory": "999m"}, False), ({"maxMemory": "1Ki"}, False),
    ({"maxMemory": "1Mi"}, True), ({"maxCpu": "1m"}, False), ({"maxCpu": "10m"}, True),
    ({"maxDiskBytes": "0.5"}, False),
    # whole bytes, within what the kernel's 64-bit limits hold (fresh-user round 16: "1.5" was used as 1,
    # and maxMemory 99999999Ei loaded)
    ({"maxDiskBytes": "1.5"}, False), ({"maxDiskBytes": 1.5}, False), ({"maxDiskBytes": "1.5Gi"}, True),
    ({"maxMemory": "99999999Ei"}, False), ({"maxDiskBytes": "9Ei"}, False), ({"maxMemory": "7Ei"}, True),
])
def test_isolation_is_checked_when_the_template_is_loaded(iso, ok):
    doc = {"kind": "ActorTemplate", "metadata": {"name": "t"},
           "spec": {"entrypoint": "workers.agents.counter:Counter", "isolation": iso}}
    if ok:
        load_documents([doc])
    else:
        with pytest.raises(SpecError):
            load_documents([doc])


def test_limits_from_a_template():
    spec = ActorTemplateSpec(entrypoint="m:C", isolation=Isolation(maxMemory="64Mi", maxCpu="250m",
                                                                    maxProcesses=10, turnTimeout="2s"))
    lim = Limits.of(spec)
    assert (lim.memory_bytes, lim.cpu_cores, lim.processes, lim.turn_timeout_s) == (64 << 20, 0.25, 10, 2.0)
    assert lim.rlimits(with_memory=True)["RLIMIT_AS"] == 64 << 20
    assert "RLIMIT_AS" not in lim.rlimits(with_memory=False)


@pytest.mark.skipif(find_bwrap() is None, reason="bubblewrap not installed")
def test_sandbox_command_line_binds_no_runtime_state(tmp_path):
    async def argv() -> list[str]:
        pool = SandboxPool(tmp_path / "w", 1, name=_unit_name(), bwrap=find_bwrap(), uid_base=29000, uid_span=500,
                           uid_lock_dir=LOCK_DIR, prestart=False)
        try:
            return pool.argv(pool.slots[0], Limits())
        finally:
            await pool.close()

    a = asyncio.run(argv())
    binds = [a[i + 1] for i, x in enumerate(a) if x in ("--bind", "--ro-bind")]
    rw = [a[i + 1] for i, x in enumerate(a) if x == "--bind"]
    assert rw == [str(tmp_path / "w" / "slots" / "0")], "only the slot folder is writable"
    root = Path(__file__).resolve().parents[2]
    for src in binds:
        assert not str(root / "var").startswith(src) and src != str(root), f"{src} exposes the runtime's files"
    assert "--unshare-net" in a and "--clearenv" in a and "--die-with-parent" in a
    assert not any("SUBSTRATE" in x for x in a)
    # the tmpfs /tmp comes before every bind: mounted later it hid a checkout or venv under /tmp (CI's
    # fresh clone lives there), and every agent failed to start with exit status 127
    tmpfs_at = a.index("--tmpfs")
    assert a[tmpfs_at + 1] == "/tmp"
    assert all(i > tmpfs_at for i, x in enumerate(a) if x in ("--bind", "--ro-bind") and a[i + 2] != "/usr")


@pytest.mark.skipif(find_bwrap() is None, reason="bubblewrap not installed")
def test_an_agent_starts_when_the_interpreter_lives_under_tmp(tmp_path):
    """End to end for the case above: the sandbox's own python runs when the runtime lives under /tmp."""
    import subprocess
    import sys

    if not sys.executable.startswith("/tmp/"):
        venv = Path(tempfile.mkdtemp(prefix="substrate-venv-", dir="/tmp"))
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        python = str(venv / "bin" / "python")
    else:
        python = sys.executable

    async def run() -> subprocess.CompletedProcess[bytes]:
        pool = SandboxPool(tmp_path / "w", 1, name=_unit_name(), bwrap=find_bwrap(), uid_base=29000, uid_span=500,
                           uid_lock_dir=LOCK_DIR, prestart=False)
        try:
            pool._site.append(str(Path(python).parent.parent))
            (pool.slots[0].dir / "workspace").mkdir(parents=True, exist_ok=True)
            a = pool.argv(pool.slots[0], Limits())
            cut = a.index("--") + 1
            argv = a[:cut] + [python, "-c", "print('alive')"]
            return subprocess.run(argv, capture_output=True, timeout=30)
        finally:
            await pool.close()

    r = asyncio.run(run())
    assert r.returncode == 0 and r.stdout == b"alive\n", r.stderr


def _tar_with(tmp_path: Path, names: list[str]) -> Path:
    import io

    import zstandard

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as t:
        for n in names:
            data = b"{}" if n == "state.json" else b"x"
            ti = tarfile.TarInfo(n)
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))
    out = tmp_path / "a.tar.zst"
    out.write_bytes(zstandard.ZstdCompressor().compress(raw.getvalue()))
    return out


def test_restore_bounds_member_names_and_counts(tmp_path, monkeypatch):
    long_name = _tar_with(tmp_path, ["state.json", "workspace/" + "a" * 300])
    with pytest.raises(SnapshotCorrupt) as e:
        archive.unpack(long_name, tmp_path / "ws", expect_session="s", expect_sha256=None)
    assert e.value.details["reason"] == "unsafe_path"
    monkeypatch.setattr(archive, "MAX_MEMBERS", 3)
    many = _tar_with(tmp_path, ["state.json"] + [f"workspace/f{i}" for i in range(5)])
    with pytest.raises(SnapshotCorrupt) as e:
        archive.unpack(many, tmp_path / "ws", expect_session="s", expect_sha256=None)
    assert e.value.details["reason"] == "too_large"
    assert not (tmp_path / "ws").exists()


def test_hash_is_checked_before_decompressing(tmp_path, monkeypatch):
    arch = _tar_with(tmp_path, ["state.json"])
    monkeypatch.setattr(archive, "_extract", lambda *a, **k: pytest.fail("decompressed before the hash check"))
    with pytest.raises(SnapshotCorrupt) as e:
        archive.unpack(arch, tmp_path / "ws", expect_session="s", expect_sha256="0" * 64)
    assert e.value.details["reason"] == "checksum_mismatch"


@pytest.mark.skipif(find_bwrap() is None, reason="bubblewrap not installed")
def test_without_libseccomp_the_worker_refuses_sandboxes_unless_the_pool_opts_out(tmp_path, monkeypatch):
    from workers import syscalls
    from workers.sandbox import SandboxUnavailable

    def missing() -> bytes:
        raise syscalls.SeccompUnavailable("libseccomp is not usable (test): install the Debian package "
                                          f"`{syscalls.LIBSECCOMP_PACKAGE}`")

    monkeypatch.setattr(syscalls, "build_bpf", missing)
    kw = dict(name="unit", bwrap=find_bwrap(), uid_base=29000, uid_span=500, uid_lock_dir=tmp_path / "locks",
              prestart=False)
    with pytest.raises(SandboxUnavailable, match="libseccomp2"):
        SandboxPool(tmp_path / "w", 1, **kw)

    async def opted_out() -> str | None:
        pool = SandboxPool(tmp_path / "w2", 1, require_sandbox=False, **kw)
        try:
            with pytest.raises(SandboxUnavailable, match="libseccomp2"):
                await pool.spawn(pool.slots[0], Limits())  # a sandboxed template still cannot start
            return pool.unavailable
        finally:
            await pool.close()

    assert "libseccomp2" in (asyncio.run(opted_out()) or "")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (per-slot uids)")
def test_a_released_slot_uid_keeps_no_kernel_keys():
    import ctypes

    from workers.syscalls import clear_uid_keyrings

    uid = 29_777
    libc = ctypes.CDLL(None, use_errno=True)

    def as_uid(nr: int, *args: object) -> int:
        pid = os.fork()
        if pid == 0:
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os._exit(0 if libc.syscall(ctypes.c_long(nr), *args) > 0 else 3)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    assert as_uid(248, b"user", b"leak", b"v", ctypes.c_size_t(1), ctypes.c_long(-4)) == 0  # add_key to @u
    # keyctl(KEYCTL_SEARCH, @u, ...): the uid's own user keyring (request_key would search the session
    # keyring, which a forked child shares with this root process)
    search = (250, ctypes.c_long(10), ctypes.c_long(-4), b"user", b"leak", ctypes.c_long(0))
    assert as_uid(*search) == 0, "found before"
    assert clear_uid_keyrings(uid)
    assert as_uid(*search) == 3, "gone after the slot is released"


def test_a_command_that_cannot_run_is_named_before_the_exec(tmp_path, monkeypatch):
    """A command agent's missing binary was only "agent process exited (exit status 127)": the host
    now says which command and why in its answer to init, looked up the way ``execvpe`` will."""
    from workers.agenthost import _not_executable

    monkeypatch.setenv("PATH", str(tmp_path))
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\n")
    assert _not_executable("tool") == f"command 'tool' not found on PATH ({tmp_path})"
    tool.chmod(0o755)
    assert _not_executable("tool") is None
    assert _not_executable(str(tool)) is None
    assert _not_executable(str(tmp_path / "nope")) == f"command '{tmp_path / 'nope'}' not found"
    assert "not an executable file" in _not_executable(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert _not_executable("./tool") is None  # from the workspace, the host's current directory
