"""An opted-out agent host (``isolation.sandbox: false``) runs as its slot's unprivileged uid when that uid
can run this Python, not as the worker's root (fresh-user round 14: one ran as root and read the runtime's
Redis password, every workspace and every snapshot). Where the uid cannot (this Python under ``/root``),
it runs as before and the worker says why, once."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from workers.sandbox import Limits, SandboxPool

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="slot uids are leased only by a worker running as root")


def _pool(tmp_path: Path) -> SandboxPool:
    return SandboxPool(tmp_path / "w", 1, name=f"unit-{uuid.uuid4().hex[:8]}", bwrap=None, uid_base=29600,
                       uid_span=300, uid_lock_dir=tmp_path / "locks", require_sandbox=False, prestart=0)


async def test_the_command_line_drops_to_the_slot_uid_with_no_new_privileges(tmp_path: Path) -> None:
    pool = _pool(tmp_path)
    try:
        slot = pool.slots[0]
        assert slot.uid is not None
        pool.unsandboxed_uid_ok = True
        argv = pool.argv(slot, Limits(sandboxed=False))
        cut = argv.index("--")
        assert argv[0] == "/usr/bin/setpriv" and argv[argv.index("--reuid") + 1] == str(slot.uid)
        assert argv[argv.index("--regid") + 1] == str(slot.uid)
        assert {"--clear-groups", "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all"} <= set(argv[:cut])
        assert argv[cut + 1] == sys.executable
        pool.unsandboxed_uid_ok = False
        assert pool.argv(slot, Limits(sandboxed=False))[0] == sys.executable
    finally:
        await pool.close()


async def test_the_probe_says_whether_the_slot_uid_can_run_this_python(tmp_path: Path, caplog) -> None:
    pool = _pool(tmp_path)
    slot = pool.slots[0]
    can = subprocess.run(["/usr/bin/setpriv", "--reuid", str(slot.uid), "--regid", str(slot.uid), "--clear-groups",
                          sys.executable, "-c", "import os, sys; os.chdir(sys.argv[1])", str(slot.dir)],
                         cwd="/", capture_output=True).returncode == 0
    with caplog.at_level(logging.WARNING, logger="substrate.sandbox"):
        await pool._probe_unsandboxed_uid(slot)
    await pool.close()
    assert pool.unsandboxed_uid_ok is can
    said = [r.getMessage() for r in caplog.records if "isolation.sandbox false" in r.getMessage()]
    assert bool(said) is (not can), said
    if said:
        assert "cannot run this Python" in said[0]


async def test_an_opted_out_host_runs_as_its_slot_uid_where_that_uid_can_run_it() -> None:
    """The pool's folder where every user can enter it (pytest's own temporary folders are 0700)."""
    import shutil
    import tempfile

    open_dir = Path(tempfile.mkdtemp(prefix="substrate-unsandboxed-", dir="/tmp"))
    open_dir.chmod(0o755)
    pool = _pool(open_dir)
    try:
        slot = pool.slots[0]
        await pool.start()
        host = await pool.spawn(slot, Limits(sandboxed=False))
        assert host.proc.stdout is not None
        first = await host.proc.stdout.readline()
        if not pool.unsandboxed_uid_ok:
            pytest.skip("the slot uid cannot run this Python here (the worker's warning says why)")
        assert first.strip() == b'{"ready": true}', first
        uids = next(line for line in Path(f"/proc/{host.proc.pid}/status").read_text().splitlines()
                    if line.startswith("Uid:")).split()[1:]
        assert uids == [str(slot.uid)] * 4, uids
        await host.close()
    finally:
        await pool.close()
        shutil.rmtree(open_dir, ignore_errors=True)
