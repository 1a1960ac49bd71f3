"""The worker's side of an agent process: JSON lines to the agent host in the session's sandbox.

Every agent runs out of the worker's process (``workers/sandbox.py``, ``workers/agenthost.py``); this
module is the only place the worker talks to it. The protocol (one JSON object per line, request then
answer; stderr is a pipe the worker logs as bounded, escaped data: ``workers/agentlog.py``) is also what a ``spec.command`` agent in any language speaks:

    -> {"op": "start", "session": "s1", "epoch": 3, "workspace": "/workspace", "state": {...} | null}
    <- {"ok": true}                (or {"error": ..., "code": "state_load_failed", "exception": "Type"}:
                                    the restored state itself cannot be loaded; see ``StateLoadFailed``)
    -> {"op": "invoke", "input": <any>, "stream": false}
    <- {"chunk": <any>}            (zero or more, for streaming)
    <- {"output": <any>}           (or {"error": "message", "code": "agent_error"})
    -> {"op": "snapshot"}
    <- {"state": {...}}           (or {"error": ..., "code": "state_too_large"}: the agent goes on)
    -> {"op": "stop"}               (the process should exit; it is killed after 2 s)

Every request but ``stop`` also carries ``"id"``: a fresh random string per request. The agent host
echoes it in every line it writes for that request (chunks, answer, error), and the worker accepts only
lines carrying the id of the request it waits for: the agent's own code runs in the host's process and
can write to the protocol pipe, and a line it writes (or a stale answer left in the pipe after it) must
never be taken as the answer to a request. Such a line is a protocol violation by the agent: the agent is
killed and the call fails with 500 ``agent_protocol_violation``, the way a crashed agent's does (the
activation ends; the session comes back from its last snapshot). The id is no secret from the agent (it
can read it from the host's memory); the point is that every answer the worker takes is the one line
answering its current request, in order, so the protocol never shifts by a line. A command agent should
echo ``id`` too (``workers/agents/echo_jsonl.py`` does); one that does not is accepted as before (it
speaks for itself: no other code shares its pipe), but once it echoes an id every later line must carry
the right one. A line of the wrong kind (e.g. ``output`` answering ``snapshot``) is a violation too.

Before ``start``, the agent host (``workers/agenthost.py``, not a command agent) writes ``{"ready": true}``
once its interpreter has started, and the worker sends the host's ``init``; for a command agent the host
answers it and ``exec``s the command, which then gets ``start``. A command runs with its
workspace as the current directory and the template's and session's env.

Failures: a turn that runs past the template's ``isolation.turnTimeout`` kills the whole sandbox and
answers 504 ``turn_timeout``; a host killed by its memory cgroup answers 422 ``memory_limit_exceeded``;
an answer (or streamed chunk) over ``worker.max_answer_bytes`` answers 422 ``output_too_large`` (refused
by the agent host, which goes on; a command agent that sends such a line anyway is killed);
any other death 500 ``agent_crashed``. The agent is then ``dead`` and is never started again inside the
same activation: every later call raises ``TurnFailed`` (``agent_crashed``) and the worker ends the
activation, so the session comes back from its last committed snapshot under a new epoch, and the
answers say so (``X-Substrate-Restored: agent_restarted``). Restarting it in place from the last
snapshot's state (as before) lost acknowledged turns inside one epoch (issue 8, chaos run).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import secrets
import sys
import time
from typing import Any, AsyncIterator

from substrate.errors import SubstrateError
from workers.handler import Agent, AgentError, SessionContext
from workers.sandbox import WORKSPACE_PATH, HostProcess, Limits, SandboxPool, Slot

_STOP_GRACE_S = 2.0
#: the least time an agent host gets to boot (before its agent's code runs), whatever the turn timeout
HOST_BOOT_FLOOR_S = 30.0
#: the error codes an agent host answers to any request (``workers.agenthost``); ``snapshot`` may also
#: answer ``state_too_large``, ``start`` ``state_load_failed`` (``_expect_ok``)
_HOST_CODES = frozenset({"agent_error", "agent_exception", "agent_crashed", "memory_limit_exceeded",
                         "output_too_large"})
_STATUS = {"turn_timeout": 504, "memory_limit_exceeded": 422, "agent_crashed": 500, "agent_error": 422,
           "agent_exception": 500,
           "agent_start_failed": 500, "output_too_large": 422, "state_load_failed": 422, "state_too_large": 422,
           "agent_protocol_violation": 500}
#: bytes a protocol line may carry beyond the answer itself (the ``{"output": ...}`` wrapping)
#: the end of the message of a turn whose agent died: the session's next turn restarts it from its last
#: snapshot (dropped from a start failure's message, which has nothing to restart)
RESTART_HINT = "; the session restarts from its last snapshot"
LINE_SLACK_BYTES = 64 * 1024


def _keys(msg: dict[str, Any]) -> str:
    """A stray line's first keys, for an error message (never its values: they may be large)."""
    return ", ".join(repr(str(k)[:40]) for k in list(msg)[:6]) or "none"



#: a number literal whose exponent may overflow a float (``1e999`` parses as inf): checked only then
_BIG_EXPONENT = re.compile(rb"[eE][+]?[0-9]{3}")
#: a ``\uD800``-``\uDFFF`` escape: only then can a parsed string hold a lone surrogate
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    v = float(text)
    if math.isinf(v):
        raise ValueError(f"{text} is out of a double's range")
    return v


def strict_json(line: bytes) -> Any:
    """``json.loads`` of an agent's protocol line, refusing what is not strict JSON (RFC 8259) or not
    Unicode: ``NaN``/``Infinity``, a number out of a double's range, and a string holding a lone
    surrogate (an escape such as ``"\ud800"``). Python accepts all of them and writes them back out,
    so an answer holding one reached clients as invalid JSON (fresh-user round 14). The checks run only
    when a cheap scan of the raw line finds what they look for. Raises ``ValueError``."""
    msg = json.loads(line, parse_constant=_no_constant,
                     parse_float=_finite if _BIG_EXPONENT.search(line) else None)
    if _SURROGATE_ESCAPE.search(line):
        stack = [msg]
        while stack:
            v = stack.pop()
            if isinstance(v, str):
                v.encode("utf-8")  # UnicodeEncodeError (a ValueError) on a lone surrogate
            elif isinstance(v, dict):
                stack.extend(v.keys())
                stack.extend(v.values())
            elif isinstance(v, list):
                stack.extend(v)
    return msg


class TurnFailed(SubstrateError):
    """A turn (or start/snapshot) failed in the agent's process; ``code`` says how."""

    def __init__(self, message: str, code: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message, code=code, details=details)
        self.status = _STATUS.get(code, 500)


class AgentGone(TurnFailed):
    """The agent's process was already gone when a call began: nothing of the call ran."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "agent_crashed")


class HostedAgent(Agent):
    """The ``Agent`` interface over a sandboxed agent host (Python ``entrypoint`` or ``command``).

    ``ctx.env`` is the already-validated template + session env. ``state`` given to ``start`` and
    returned by ``snapshot`` is plain JSON; the worker never unpickles anything an agent wrote.
    """

    def __init__(self, ctx: SessionContext, *, pool: SandboxPool, slot: Slot, limits: Limits,
                 entrypoint: str | None, argv: list[str] | None, max_answer_bytes: int = 16 * 1024 * 1024) -> None:
        super().__init__(ctx)
        #: the largest answer line the host may send (it refuses bigger ones with ``output_too_large``)
        self.max_answer_bytes = max_answer_bytes
        self.pool = pool
        self.slot = slot
        self.limits = limits
        self.entrypoint = entrypoint
        # a template that starts "python"/"python3" means this runtime's interpreter (and its packages),
        # not whichever python is first on PATH (the sandbox binds that interpreter read-only)
        if argv and argv[0] in ("python", "python3"):
            argv = [sys.executable, *argv[1:]]
        self.argv = argv
        self.host: HostProcess | None = None
        self._state: dict[str, Any] | None = None
        #: the host was started once; it is never started again (see ``dead``)
        self._started = False
        #: a call is waiting for the host's answer (a stop meanwhile kills instead of talking)
        self._reading = False
        #: every line must carry its request's ``id``: always for the Python agent host; for a command
        #: agent once it has echoed one (an older command agent that never does is taken at its word)
        self._ids_required = argv is None

    @property
    def dead(self) -> bool:
        """True once the agent's process died or was killed after it started (crash, memory limit, turn
        timeout, a broken line): its state since the last snapshot is gone and it is not restarted here;
        the worker ends the activation (``workers.server``)."""
        return self._started and (self.host is None or not self.host.alive)

    @property
    def workspace_in_sandbox(self) -> str:
        return WORKSPACE_PATH if self.limits.sandboxed else str(self.slot.workspace)

    # ------------------------------------------------------------------------------------- transport
    async def _send(self, msg: dict[str, Any]) -> str:
        """Send one request with a fresh ``id`` (see the module docstring); returns that id, which the
        answer's lines must carry (pass it to ``_recv``). Raises ``TurnFailed`` if the process is gone."""
        host = self.host
        if host is None or host.proc.stdin is None:
            raise TurnFailed("agent process is not running", "agent_crashed")
        rid = secrets.token_hex(8)
        try:
            host.proc.stdin.write(json.dumps({**msg, "id": rid}).encode() + b"\n")
            await host.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as e:
            raise await self._died(f"agent process went away ({e.__class__.__name__})") from e
        return rid

    async def _violation(self, what: str) -> TurnFailed:
        """Kill the agent for breaking the protocol and return the error to raise: 500
        ``agent_protocol_violation`` (the agent is then ``dead``: the activation ends as a crash's)."""
        await self._kill()
        return TurnFailed(f"the agent broke the protocol ({what}); its process was killed{RESTART_HINT}",
                          "agent_protocol_violation")

    async def _recv(self, deadline: float, rid: str, *, kinds: tuple[str, ...],
                    strict: bool | None = None) -> dict[str, Any]:
        """The next line of the answer to request ``rid`` (what ``_send`` returned), which must carry one
        of the keys ``kinds`` (or ``error``). ``strict``: the line must carry ``id`` (default: whether
        this agent echoes ids). Raises ``TurnFailed``: ``turn_timeout`` past ``deadline`` (monotonic s),
        ``output_too_large``, ``agent_crashed`` (process gone, not JSON), ``agent_protocol_violation``
        (a line not answering ``rid``, or of another kind); the agent is killed for every one of them."""
        msg = await self._read_line(deadline)
        got = msg.get("id")
        if strict is None:
            strict = self._ids_required
        if got is not None or strict:
            if got != rid:
                seen = "no id" if got is None else f"id {str(got)[:40]!r}"
                # it may have been written any time since the previous answer (a process the agent left
                # behind, a cell writing to the pipe): say so, not only that this request got it
                raise await self._violation(f"a line that answers no current request ({seen}; its keys: "
                                            f"{_keys(msg)}), read while waiting for the answer to request {rid}: "
                                            "written by the agent's code since its previous answer or now")
            if not strict:  # a command agent that echoes ids: every later line must carry the right one
                self._ids_required = True
        if not any(k in msg for k in (*kinds, "error")):
            raise await self._violation(f"a line with none of {', '.join(kinds)} or error; its keys: {_keys(msg)}")
        return msg

    async def _read_line(self, deadline: float) -> dict[str, Any]:
        host = self.host
        assert host is not None and host.proc.stdout is not None
        self._reading = True
        try:
            # asyncio.timeout, not wait_for: wait_for ran each line's read in a Task of its own (3.11)
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                line = await host.proc.stdout.readline()
        except TimeoutError:
            await self._kill()
            raise TurnFailed(f"turn ran over isolation.turnTimeout ({self.limits.turn_timeout_s:g} s); every "
                             f"process of the session was killed{RESTART_HINT}", "turn_timeout") from None
        except (ValueError, asyncio.LimitOverrunError) as e:  # a line over the reader's limit
            # (a command agent that ignores maxAnswerBytes; the Python host refuses such answers itself)
            await self._kill()
            raise TurnFailed(f"the agent's answer is over the {self.max_answer_bytes}-byte limit "
                             f"(worker.max_answer_bytes); its process was killed{RESTART_HINT}",
                             "output_too_large") from e
        finally:
            self._reading = False
        if not line:
            raise await self._died("agent process exited")
        try:
            msg = strict_json(line)
        except (ValueError, RecursionError) as e:
            await self._kill()
            raise TurnFailed(f"agent wrote a line that is not JSON ({e}): {line[:200]!r}", "agent_crashed") from e
        if not isinstance(msg, dict):
            await self._kill()
            raise TurnFailed(f"agent wrote a JSON line that is not an object: {line[:200]!r}", "agent_crashed")
        return msg

    async def _died(self, what: str) -> TurnFailed:
        host, self.host = self.host, None
        code = None
        if host is not None:
            host.kill()
            with contextlib.suppress(ProcessLookupError):
                code = await host.proc.wait()
        cg = self.slot.cgroup
        if cg is not None and cg.new_oom_kill():
            return TurnFailed(f"the session went over isolation.maxMemory "
                              f"({self.limits.memory_bytes} bytes) and its agent was killed{RESTART_HINT}",
                              "memory_limit_exceeded")
        return TurnFailed(f"{what} (exit status {code}){RESTART_HINT}", "agent_crashed")

    async def _kill(self) -> None:
        host, self.host = self.host, None
        if host is not None:
            await host.close()

    def _deadline(self) -> float:
        return time.monotonic() + self.limits.turn_timeout_s

    # ------------------------------------------------------------------------------------ lifecycle
    async def _boot(self) -> None:
        self._oom_baseline()  # an earlier session's OOM in this slot is not this one's
        self.host = await self.pool.host_for(self.slot, self.limits)
        self._started = True
        self.host.session, self.host.epoch = self.ctx.session_id, self.ctx.epoch  # labels its logged stderr
        # the host's own boot (bwrap, the interpreter: none of the agent's code) gets at least
        # ``HOST_BOOT_FLOOR_S``: bounded by a 1 s turnTimeout, creates failed 500 agent_start_failed on a
        # loaded machine; the agent's init and start get the turn timeout, counted from the boot's end
        await self._booted(time.monotonic() + max(self.limits.turn_timeout_s, HOST_BOOT_FLOOR_S))
        deadline = self._deadline()
        with_memory_rlimit = self.slot.cgroup is None
        start = {"op": "start", "session": self.ctx.session_id, "epoch": self.ctx.epoch,
                 "workspace": self.workspace_in_sandbox, "state": self._state}
        init_id = await self._send({"op": "init", "entrypoint": self.entrypoint, "argv": self.argv,
                          "env": self.ctx.env, "session": self.ctx.session_id, "epoch": self.ctx.epoch,
                          "template": self.ctx.template, "workspace": self.workspace_in_sandbox,
                          "rlimits": self.limits.rlimits(with_memory_rlimit), "sandboxed": self.limits.sandboxed,
                          "maxAnswerBytes": self.max_answer_bytes,
                          "limits": {"turnTimeoutS": self.limits.turn_timeout_s,
                                     "memoryBytes": self.limits.memory_bytes,
                                     "diskBytes": self.limits.disk_bytes}})
        # a Python agent's host reads one line at a time, so ``start`` can follow ``init`` at once (one
        # round trip to the sandbox, not two); a command agent's host ``exec``s after answering init, and
        # a line already sent would sit in the host's read buffer and be lost: it waits for the answer
        pipelined = self.argv is None
        if pipelined:
            start_id = await self._send(start)
        # the host itself answers init (always with the id), even for a command agent
        await self._expect_ok(await self._recv(deadline, init_id, kinds=("ok",), strict=True), "init")
        if not pipelined:
            start_id = await self._send(start)
        await self._expect_ok(await self._recv(deadline, start_id, kinds=("ok",)), "start")

    async def _booted(self, deadline: float) -> None:
        """Consume the start-up line of a host spawned for this activation (a pre-started one has been
        read by the pool already). Raises ``TurnFailed`` ``agent_start_failed``."""
        host = self.host
        assert host is not None
        try:
            await host.wait_booted(max(0.0, deadline - time.monotonic()))
        except (RuntimeError, asyncio.TimeoutError, ValueError, asyncio.LimitOverrunError) as e:
            await self._kill()
            cg = self.slot.cgroup
            if cg is not None and self.limits.memory_bytes and cg.new_oom_kill():
                # spawned under the limit (``SandboxPool.host_for``) and killed for memory before it
                # could say it started: the interpreter alone does not fit (a fresh-user run: 1Mi)
                raise TurnFailed(f"the agent host needs more memory to start than isolation.maxMemory "
                                 f"({self.limits.memory_bytes} bytes) allows; raise the template's maxMemory",
                                 "memory_limit_exceeded") from e
            # str(e): an exception object is always true, and a timeout's message is empty
            why = "timed out" if isinstance(e, asyncio.TimeoutError) else (str(e) or type(e).__name__)
            raise TurnFailed(why if why.startswith("agent host did not start") else f"agent host did not start: {why}",
                             "agent_start_failed") from e

    async def _expect_ok(self, reply: dict[str, Any], what: str) -> None:
        """Raise ``TurnFailed`` unless ``reply`` is ``{"ok": true}`` (the host is killed first): code
        ``state_load_failed`` (details ``exception``) only when the host answered exactly that to
        ``start`` (its positive word that the restored state is unusable), else ``agent_start_failed``."""
        if not reply.get("ok"):
            await self._kill()
            if what == "start" and reply.get("code") == "state_load_failed":
                kind = str(reply.get("exception") or "unknown")[:200]
                raise TurnFailed(f"the session's saved state could not be loaded ({kind}): "
                                 f"{str(reply.get('error', ''))[:1000]}", "state_load_failed",
                                 details={"exception": kind})
            raise TurnFailed(f"agent failed to {what}: {reply.get('error', reply)}", "agent_start_failed")

    async def _ensure(self) -> None:
        """Raise ``TurnFailed`` (``agent_crashed``) if the agent's process is gone (it is not restarted).
        Before each call to the agent: a death during it is an OOM only if the slot's OOM count moved
        during it (``SlotCgroup.mark_oom_baseline``; one small cgroupfs read, and only under a memory limit)."""
        if self.host is None or not self.host.alive:
            await self._kill()
            raise AgentGone("the agent process is not running (it died or was killed); the session comes "
                            "back from its last snapshot")
        self._oom_baseline()

    def _oom_baseline(self) -> None:
        cg = self.slot.cgroup
        if cg is not None and self.limits.memory_bytes:
            cg.mark_oom_baseline()

    async def start(self, state: dict[str, Any] | None) -> None:
        self._state = state
        await self._boot()

    async def stream(self, input: Any) -> AsyncIterator[Any]:  # noqa: A002
        """The turn's chunks as they come. Closed before the answer's last line (its consumer went away:
        ``aclose``), it reads the rest of the answer first, within the turn's deadline: the turn runs to
        its end in the agent anyway, and a line of it left in the pipe was read by the next request as its
        own, a protocol violation that killed the agent and lost its state (a fresh-user run: a client
        timing out on a streamed turn rolled the session back to its last snapshot)."""
        await self._ensure()
        deadline = self._deadline()
        rid = await self._send({"op": "invoke", "input": input, "stream": True})
        ended = False
        try:
            while True:
                msg = await self._recv(deadline, rid, kinds=("chunk", "output"))
                if "chunk" in msg:
                    yield msg["chunk"]
                    continue
                ended = True
                if "output" not in msg:
                    raise self._error(msg)
                if not msg.get("streamed"):  # a command agent that answers without chunks
                    yield msg["output"]
                return
        finally:
            if not ended and self.host is not None:  # closed mid-answer (a failed read killed the host)
                await self._drain(deadline, rid)

    async def _drain(self, deadline: float, rid: str) -> None:
        """Read and drop the rest of the answer to ``rid`` (see ``stream``). A drain that fails (the turn
        ran over its deadline, the agent died or broke the protocol) has killed the agent, as the turn
        itself would have: the next request finds it ``dead``."""
        with contextlib.suppress(TurnFailed):
            while "chunk" in await self._recv(deadline, rid, kinds=("chunk", "output")):
                pass

    async def invoke(self, input: Any) -> Any:  # noqa: A002
        await self._ensure()
        deadline = self._deadline()
        rid = await self._send({"op": "invoke", "input": input, "stream": False})
        last = None
        while True:
            msg = await self._recv(deadline, rid, kinds=("chunk", "output"))
            if "chunk" in msg:
                last = msg["chunk"]
            elif "output" in msg:
                return msg["output"] if not msg.get("streamed") else last
            else:
                raise self._error(msg)

    @staticmethod
    def _error(msg: dict[str, Any], also: tuple[str, ...] = ()) -> Exception:
        """The exception for an agent host's error answer: its ``code`` if the host may answer it to this
        request (``_HOST_CODES`` plus ``also``), else ``agent_exception`` (the agent failed the call; its
        process lives on). The agent's own code can write any line to the protocol pipe: a forged
        ``state_load_failed`` answering a turn was passed on as 422 ``state_load_failed`` while the
        session stayed RUNNING (fresh-user round 14)."""
        code = str(msg.get("code") or "agent_error")
        text = str(msg.get("error", msg))
        if code == "agent_error":
            return AgentError(text)
        return TurnFailed(text, code if code in _HOST_CODES or code in also else "agent_exception")

    async def snapshot(self) -> dict[str, Any]:
        await self._ensure()
        rid = await self._send({"op": "snapshot"})
        msg = await self._recv(self._deadline(), rid, kinds=("state",))
        if "state" not in msg:
            err = self._error(msg, also=("state_too_large",))
            # a snapshot's callers (suspend, periodic snapshot) handle ``SubstrateError``s only: an agent
            # that refuses a snapshot is a failed call of 422 ``agent_error``, never an unhandled exception
            raise TurnFailed(str(err), "agent_error") if isinstance(err, AgentError) else err
        state = msg.get("state")
        if state is None:  # the agent has no state to keep
            state = {}
        if not isinstance(state, dict):
            # the agent refusing a snapshot, as one that raises: 422, the session keeps running (it was 500
            # ``agent_crashed``, the code of a dead agent; and ``[]`` or ``0`` were kept as ``{}``: fresh-user run)
            raise TurnFailed(f"agent snapshot state is not a JSON object (got {type(state).__name__})", "agent_error")
        self._state = state
        return state

    def freeze(self, frozen: bool) -> None:
        """Stop (or resume) every process of the session while its workspace is packed, so no agent
        process can swap a file for a link under the packer's feet (cgroup freezer; no-op without)."""
        if self.slot.cgroup is not None:
            self.slot.cgroup.freeze(frozen)

    async def stop(self) -> None:
        host = self.host
        if host is None or not host.alive or self._reading:  # mid-turn (a DELETE): kill, do not talk
            await self._kill()
            return
        try:
            await self._send({"op": "stop"})
            await asyncio.wait_for(host.proc.wait(), _STOP_GRACE_S)
        except (asyncio.TimeoutError, TurnFailed):
            pass
        finally:
            await self._kill()
