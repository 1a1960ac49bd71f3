"""Pluggable memory checkpointing: what a snapshot captures beyond the portable core.

The **portable core** (always, :class:`NoCheckpointer`, the default) is the session's workspace files and
the agent state the handler returns (``state.json``), packed by ``snapshot.archive``. On resume the agent
process starts fresh and reloads that state. It captures everything an agent chooses to persist and
survives any move between workers, kernels and runtimes. It loses everything that only lived in the process:
variables the agent did not put in its state, open file offsets, threads, child processes, network
connections, timers, caches, GPU memory.

A :class:`Checkpointer` adds a process-memory image on top of the core:

* :class:`GVisorCheckpointer` -- ``runsc checkpoint`` / ``runsc restore`` of a gVisor sandbox. Captures the
  sandbox kernel's state: all memory, processes and threads, open files. The restore must use the same runsc
  version, the same top-level runsc flags and a compatible container spec. Treat as lost: network
  connections to peers outside the sandbox (they do not follow the session to another host), host file
  descriptors or mounts the spec does not recreate, and GPU state (upstream nvproxy checkpointing is
  experimental and fails with live CUDA contexts).
* :class:`CriuCheckpointer` -- ``criu dump`` / ``criu restore`` of a process tree on the host. Captures the
  memory, registers, threads, open regular files (by path and offset: the files must be at the same paths
  on restore, which the workspace restore provides), pipes and ptys. Lost or refused: established TCP
  connections (not dumped without ``--tcp-established``, and useless on another host anyway), listening
  sockets bound to host ports may conflict on restore, GPU memory (CUDA contexts are not dumpable without
  vendor plugins), inotify watches on other trees; it needs root or CAP_CHECKPOINT_RESTORE and a kernel
  and CPU compatible with the dump's.

Neither image is small (it is the process's resident memory) nor portable across CPU feature sets, so they
are an optimisation for warm, same-fleet resumes, never a replacement for the portable core: a resume whose
image cannot be restored falls back to the core. This module only produces and consumes image directories;
shipping them to object storage is the caller's business.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Protocol, runtime_checkable

from substrate.errors import SubstrateError

#: name of the image directory created inside the activation directory
IMAGE_DIR = "checkpoint"


class CheckpointUnsupported(SubstrateError, NotImplementedError):
    """The checkpoint tool is not installed (or not usable) on this worker."""

    status, code = 501, "checkpoint_unsupported"


class CheckpointFailed(SubstrateError):
    """The checkpoint tool ran and failed; ``details`` has its exit code and the tail of its stderr."""

    status, code = 500, "checkpoint_failed"


@runtime_checkable
class Checkpointer(Protocol):
    """The memory-checkpoint step of a snapshot (after the agent quiesced, before the workspace is packed)."""

    #: what the images capture, for humans (status pages, docs)
    captures: str

    async def checkpoint(self, activation_dir: Path, pid: int) -> Path | None:
        """Dump the process (tree) ``pid`` of the activation; returns the image directory or None (no image).

        Raises ``CheckpointUnsupported`` if the tool is missing, ``CheckpointFailed`` if it fails.
        """
        ...

    async def restore(self, activation_dir: Path, image_dir: Path) -> int | None:
        """Restore the images in ``image_dir`` for the activation; returns the new root pid, or None when the
        caller must start the agent itself (portable core only).

        Raises ``CheckpointUnsupported`` or ``CheckpointFailed``.
        """
        ...


class NoCheckpointer:
    """The default: no memory image. The snapshot is the portable core (workspace files + agent state)."""

    captures = "workspace files and agent state (portable core); process memory is not captured"

    async def checkpoint(self, activation_dir: Path, pid: int) -> Path | None:
        return None

    async def restore(self, activation_dir: Path, image_dir: Path) -> int | None:
        return None


async def _run(argv: list[str], timeout_s: float) -> str:
    """Run a tool; returns its stdout. Raises ``CheckpointFailed`` on a non-zero exit or timeout."""
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise CheckpointFailed(f"{argv[0]} timed out after {timeout_s} s", details={"argv": argv}) from None
    if proc.returncode != 0:
        tail = err.decode(errors="replace")[-2000:]
        raise CheckpointFailed(f"{Path(argv[0]).name} {argv[1]} failed with exit code {proc.returncode}",
                               details={"argv": argv, "exitCode": proc.returncode, "stderr": tail})
    return out.decode(errors="replace")


def _require(binary: str, what: str) -> str:
    path = shutil.which(binary)
    if path is None:
        raise CheckpointUnsupported(
            f"{what} checkpointing needs the {binary!r} binary, which is not installed on this worker; "
            "use the default NoCheckpointer (workspace + agent state)", details={"binary": binary})
    return path


class GVisorCheckpointer:
    """Checkpoint a gVisor sandbox with ``runsc checkpoint``; restore with ``runsc restore``.

    gVisor addresses containers by ID, not pid: ``container_id`` names the activation's container (by
    default the activation directory's name); ``bundle_dir`` is the OCI bundle used to restore (by default
    ``<activation_dir>/bundle``). ``runsc_args`` are global flags (``--root``, ``--platform``...).
    """

    captures = ("full sandbox memory, processes, threads and open files (gVisor); "
                "lost: connections to outside peers, GPU memory")

    def __init__(self, *, binary: str = "runsc", runsc_args: tuple[str, ...] = (), timeout_s: float = 120.0,
                 container_id: str | None = None) -> None:
        self.binary = binary
        self.runsc_args = tuple(runsc_args)
        self.timeout_s = timeout_s
        self.container_id = container_id

    def _cid(self, activation_dir: Path) -> str:
        return self.container_id or Path(activation_dir).name

    async def checkpoint(self, activation_dir: Path, pid: int) -> Path | None:
        runsc = _require(self.binary, "gVisor")
        image = Path(activation_dir) / IMAGE_DIR
        image.mkdir(parents=True, exist_ok=True)
        await _run([runsc, *self.runsc_args, "checkpoint", f"--image-path={image}", self._cid(activation_dir)],
                   self.timeout_s)
        return image

    async def restore(self, activation_dir: Path, image_dir: Path) -> int | None:
        runsc = _require(self.binary, "gVisor")
        bundle = Path(activation_dir) / "bundle"
        await _run([runsc, *self.runsc_args, "restore", f"--image-path={image_dir}", f"--bundle={bundle}",
                    "--detach", self._cid(activation_dir)], self.timeout_s)
        return None  # the sandbox runs under runsc; the caller talks to it by container id


class CriuCheckpointer:
    """Checkpoint a host process tree with ``criu dump``; restore with ``criu restore --restore-detached``.

    Needs root (or CAP_CHECKPOINT_RESTORE). ``shell_job`` must be True for processes attached to a
    terminal; established TCP connections make the dump fail (they are deliberately not dumped).
    """

    captures = ("process tree memory, threads, open files (by path), pipes (CRIU); "
                "lost: TCP connections, GPU memory; same kernel/CPU family required")

    def __init__(self, *, binary: str = "criu", shell_job: bool = False, timeout_s: float = 120.0) -> None:
        self.binary = binary
        self.shell_job = shell_job
        self.timeout_s = timeout_s

    async def checkpoint(self, activation_dir: Path, pid: int) -> Path | None:
        criu = _require(self.binary, "CRIU")
        image = Path(activation_dir) / IMAGE_DIR
        image.mkdir(parents=True, exist_ok=True)
        argv = [criu, "dump", "--tree", str(pid), "--images-dir", str(image), "--file-locks"]
        if self.shell_job:
            argv.append("--shell-job")
        await _run(argv, self.timeout_s)
        return image

    async def restore(self, activation_dir: Path, image_dir: Path) -> int | None:
        criu = _require(self.binary, "CRIU")
        pidfile = Path(activation_dir) / "criu-restore.pid"
        argv = [criu, "restore", "--images-dir", str(image_dir), "--restore-detached", "--file-locks",
                "--pidfile", str(pidfile)]
        if self.shell_job:
            argv.append("--shell-job")
        await _run(argv, self.timeout_s)
        try:
            return int(pidfile.read_text().strip())
        except (OSError, ValueError) as e:
            raise CheckpointFailed("criu restore left no readable pidfile", details={"pidfile": str(pidfile)}) from e
