"""The worker/agent-host protocol's request ids (``workers/command.py``, ``workers/agenthost.py``).

Agent code runs in its agent host's process and can write to the protocol pipe itself (a notebook cell
finds the ``Host`` object with ``gc``). A line that does not answer the worker's current request must
never be taken as its answer: the agent is killed (500 ``agent_protocol_violation``, the activation
ends as a crashed agent's), and no later call is answered with another request's line.

Real agent host processes, unsandboxed (like ``test_prestart``), no timing asserted: every wait is
bounded only so a broken host fails the test instead of hanging it.
"""

from __future__ import annotations

import sys
import textwrap
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from workers.command import HostedAgent, TurnFailed
from workers.handler import SessionContext
from workers.sandbox import Limits, SandboxPool

UNSANDBOXED = Limits(sandboxed=False, turn_timeout_s=60.0)

#: a cell that writes a forged answer (no id) straight to the host's protocol pipe, then ends normally
FORGE = ('import gc\nh = [o for o in gc.get_objects() if type(o).__name__ == "Host"][0]\n'
         'h.out.write(b\'{"output": "FORGED"}\\n\'); h.out.flush()\n"real"')
#: the same, with the id of the request being answered, read from the host's memory (it is no secret)
FORGE_WITH_ID = ('import gc, json\nh = [o for o in gc.get_objects() if type(o).__name__ == "Host"][0]\n'
                 'h.out.write(json.dumps({"output": "FORGED", "id": h.rid}).encode() + b"\\n"); h.out.flush()\n'
                 '"real"')


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[SandboxPool]:
    p = SandboxPool(tmp_path / "w", 1, name=f"unit-{uuid.uuid4().hex[:8]}", bwrap=None, uid_base=29600,
                    uid_span=200, uid_lock_dir=tmp_path / "locks", require_sandbox=False, prestart=0)
    await p.start()
    yield p
    await p.close()


async def _agent(pool: SandboxPool, entrypoint: str | None, argv: list[str] | None = None) -> HostedAgent:
    slot = await pool.acquire()
    ctx = SessionContext(session_id="s1", epoch=1, template="t", workspace=slot.workspace)
    agent = HostedAgent(ctx, pool=pool, slot=slot, limits=UNSANDBOXED, entrypoint=entrypoint, argv=argv)
    await agent.start(None)
    return agent


async def _done(pool: SandboxPool, agent: HostedAgent) -> None:
    await agent.stop()
    await pool.release(agent.slot, None)


async def test_a_line_forged_by_the_agent_is_a_protocol_violation_not_the_answer(pool: SandboxPool) -> None:
    agent = await _agent(pool, "workers.agents.notebook:Notebook")
    try:
        assert (await agent.invoke("x = 41\nx + 1"))["repr"] == "42"
        with pytest.raises(TurnFailed) as e:
            await agent.invoke(FORGE)
        assert e.value.code == "agent_protocol_violation" and e.value.status == 500
        assert "FORGED" not in e.value.message
        # killed, like a crashed agent: the worker ends the activation (``agent.dead``), and nothing
        # more is read from the pipe (the host's real answer "real" is never taken for a later call)
        assert agent.dead
        with pytest.raises(TurnFailed) as again:
            await agent.invoke("1")
        assert again.value.code == "agent_crashed"
    finally:
        await _done(pool, agent)


async def test_a_forged_line_with_the_current_id_never_shifts_the_protocol(pool: SandboxPool) -> None:
    """The agent can read the current id; then its line is its own answer to its own turn (as any answer
    of the agent is), and the host's real answer left behind is the out-of-order line: the next call
    fails as a violation instead of being answered with the previous turn's answer."""
    agent = await _agent(pool, "workers.agents.notebook:Notebook")
    try:
        assert await agent.invoke(FORGE_WITH_ID) == "FORGED"
        with pytest.raises(TurnFailed) as e:
            await agent.invoke("1 + 1")
        assert e.value.code == "agent_protocol_violation"
        assert agent.dead
    finally:
        await _done(pool, agent)


async def test_a_snapshot_answered_with_a_turns_answer_is_a_violation(pool: SandboxPool) -> None:
    """A line of the wrong kind (``output`` for ``snapshot``, even with the right id) is a violation: a
    ``SubstrateError`` the worker's suspend handles, never an ``AgentError`` carrying the agent's line."""
    script = textwrap.dedent("""
        import json, sys
        for line in sys.stdin:
            msg = json.loads(line)
            if msg.get("op") == "stop":
                break
            reply = {"output": {"state": "x"}} if msg.get("op") == "snapshot" else {"ok": True}
            sys.stdout.write(json.dumps({**reply, "id": msg.get("id")}) + "\\n")
            sys.stdout.flush()
    """)
    agent = await _agent(pool, None, [sys.executable, "-c", script])
    try:
        with pytest.raises(TurnFailed) as e:
            await agent.snapshot()
        assert e.value.code == "agent_protocol_violation" and agent.dead
    finally:
        await _done(pool, agent)


async def test_a_command_agent_that_does_not_echo_ids_still_works(pool: SandboxPool) -> None:
    """Command agents written before ids existed answer without one: taken at their word (they share their
    pipe with no other code); the shipped example echoes ids, and then every line must carry the right one."""
    script = textwrap.dedent("""
        import json, sys
        n = 0
        for line in sys.stdin:
            msg = json.loads(line)
            op = msg.get("op")
            if op == "stop":
                break
            n += op == "invoke"
            reply = {"output": n} if op == "invoke" else {"state": {}} if op == "snapshot" else {"ok": True}
            sys.stdout.write(json.dumps(reply) + "\\n")
            sys.stdout.flush()
    """)
    agent = await _agent(pool, None, [sys.executable, "-c", script])
    try:
        assert [await agent.invoke(None) for _ in range(3)] == [1, 2, 3]
        assert await agent.snapshot() == {}
    finally:
        await _done(pool, agent)
    echo = await _agent(pool, None, [sys.executable, "-m", "workers.agents.echo_jsonl"])
    try:
        assert (await echo.invoke("hi"))["turns"] == 1
        assert echo._ids_required  # it echoed: from now on a line without the right id is a violation
    finally:
        await _done(pool, echo)


async def test_an_unexpected_error_in_a_worker_call_answers_json_internal(tmp_path: Path) -> None:
    """A bug in a worker's handler answers 500 ``internal`` as JSON (logged), never aiohttp's plain-text
    "Server got itself in trouble", which the router could only pass on as an opaque ``worker_error``."""
    from types import SimpleNamespace

    from aiohttp.test_utils import TestClient, TestServer

    from snapshot.commit import SnapshotManager
    from snapshot.store import make_store
    from substrate.directory import Directory
    from substrate.settings import Settings
    from workers.server import Worker

    settings = Settings()
    directory = Directory("redis://127.0.0.1:1/0", f"u{uuid.uuid4().hex[:8]}")  # never reached here
    snaps = SnapshotManager(make_store(settings.snapshot), directory, settings.snapshot, tmp_path / "tmp")
    worker = Worker(settings, directory, snaps, worker_id="w1", pool="default", slots=1, root=tmp_path,
                    sandboxes=None)  # type: ignore[arg-type]

    async def claims(request: object, sid: str, **_: object) -> SimpleNamespace:
        return SimpleNamespace(session=sid, epoch=1, tenant="")

    async def broken(*_: object, **__: object) -> None:
        raise KeyError("a bug")

    worker.authorize = claims  # type: ignore[method-assign]
    worker.suspend = broken  # type: ignore[method-assign]
    async with TestClient(TestServer(worker.app())) as client:
        r = await client.post("/v1/activations/s1/suspend", headers={"Authorization": "Bearer x"})
        assert r.status == 500
        body = await r.json()
        assert body["code"] == "internal" and "KeyError" in body["message"]
        r = await client.get("/no/such/route", headers={"Authorization": "Bearer x"})
        assert r.status == 404  # aiohttp's own HTTP answers pass through
    await directory.close()


async def test_a_suspend_names_its_reason_and_an_unknown_one_is_refused(tmp_path: Path) -> None:
    """The router passes why it suspends (``suspendReason`` on the record); the worker refuses a reason it
    does not know with 422 ``invalid_reason`` before it touches the session."""
    from types import SimpleNamespace

    from aiohttp.test_utils import TestClient, TestServer

    from snapshot.commit import SnapshotManager
    from snapshot.store import make_store
    from substrate.directory import Directory
    from substrate.models import SnapshotRef
    from substrate.settings import Settings
    from workers.server import Worker

    settings = Settings()
    directory = Directory("redis://127.0.0.1:1/0", f"u{uuid.uuid4().hex[:8]}")  # never reached here
    snaps = SnapshotManager(make_store(settings.snapshot), directory, settings.snapshot, tmp_path / "tmp")
    worker = Worker(settings, directory, snaps, worker_id="w1", pool="default", slots=1, root=tmp_path,
                    sandboxes=None)  # type: ignore[arg-type]
    calls: list[str] = []

    async def claims(request: object, sid: str, **_: object) -> SimpleNamespace:
        return SimpleNamespace(session=sid, epoch=1, tenant="")

    async def suspend(sid: str, epoch: int, idle_s: object, wait_s: object = None, reason: str = "?") -> SnapshotRef:
        calls.append(reason)
        return SnapshotRef(key="k", epoch=epoch, sizeBytes=1, createdAt=1.0, sha256="0" * 64)

    worker.authorize = claims  # type: ignore[method-assign]
    worker.suspend = suspend  # type: ignore[method-assign]
    async with TestClient(TestServer(worker.app())) as client:
        auth = {"Authorization": "Bearer x"}
        for why in ("idle", "pressure", "drain"):
            r = await client.post("/v1/activations/s1/suspend", params={"reason": why}, headers=auth)
            assert r.status == 200, await r.text()
        r = await client.post("/v1/activations/s1/suspend", headers=auth)
        assert r.status == 200
        r = await client.post("/v1/activations/s1/suspend", params={"reason": "whim"}, headers=auth)
        assert r.status == 422 and (await r.json())["code"] == "invalid_reason"
    assert calls == ["idle", "pressure", "drain", "explicit"], "the refused call never reached suspend"
    await directory.close()


async def test_a_host_that_does_not_boot_in_time_says_it_timed_out(pool: SandboxPool, monkeypatch) -> None:
    """The message was "agent host did not start: " (fresh-user run): an empty TimeoutError was formatted."""
    from workers import command

    monkeypatch.setattr(command, "HOST_BOOT_FLOOR_S", 1e-6)  # the boot's own bound, made too short
    slot = await pool.acquire()
    ctx = SessionContext(session_id="s1", epoch=1, template="t", workspace=slot.workspace)
    agent = HostedAgent(ctx, pool=pool, slot=slot, limits=Limits(sandboxed=False, turn_timeout_s=1e-6),
                        entrypoint="workers.agents.counter:Counter", argv=None)
    with pytest.raises(TurnFailed) as e:
        await agent.start(None)
    assert e.value.code == "agent_start_failed"
    assert str(e.value) == "agent host did not start: timed out", str(e.value)
    await pool.release(slot, None)


async def test_a_stream_closed_mid_answer_reads_the_rest_so_the_next_call_gets_its_own(pool: SandboxPool) -> None:
    # its consumer went away after the first chunk (aclose): the turn's remaining lines must not be left
    # in the pipe for the next request (they were read as its answer: a protocol violation, agent killed)
    agent = await _agent(pool, "workers.agents.notebook:Notebook")
    try:
        gen = agent.stream("import time\nprint('a', flush=True)\ntime.sleep(0.3)\nprint('b')\nx = 5\nx")
        await gen.__anext__()  # the first chunk; the rest is still to come
        await gen.aclose()
        assert not agent.dead
        assert (await agent.invoke("x * 2"))["repr"] == "10"  # the cut turn ran to its end, and this is ours
    finally:
        await _done(pool, agent)


async def test_the_hosts_boot_is_not_bounded_by_a_short_turn_timeout(pool: SandboxPool, monkeypatch) -> None:
    """Regression: the agent host's own boot (bwrap and the interpreter, before any of the agent's code)
    was bounded by the template's turnTimeout: with ``turnTimeout: 1s`` creates failed 500
    ``agent_start_failed`` on a loaded machine (the suite at 4 workers). It gets at least
    ``HOST_BOOT_FLOOR_S``; init and start still get the turn timeout."""
    from workers import command
    from workers.sandbox import HostProcess

    asked: list[float] = []
    real = HostProcess.wait_booted

    async def recording(self: HostProcess, timeout_s: float) -> None:
        asked.append(timeout_s)
        await real(self, timeout_s)

    monkeypatch.setattr(HostProcess, "wait_booted", recording)
    slot = await pool.acquire()
    ctx = SessionContext(session_id="s1", epoch=1, template="t", workspace=slot.workspace)
    agent = HostedAgent(ctx, pool=pool, slot=slot, limits=Limits(sandboxed=False, turn_timeout_s=1.0),
                        entrypoint="workers.agents.counter:Counter", argv=None)
    await agent.start(None)
    try:
        assert asked and asked[0] > command.HOST_BOOT_FLOOR_S - 1, asked
        assert await agent.invoke("increment") == {"count": 1}
    finally:
        await _done(pool, agent)


async def test_agent_code_that_raises_fails_the_call_and_the_agent_lives_on(pool: SandboxPool) -> None:
    """Fresh-user run: a turn whose agent code raised was 500 ``agent_crashed``, the code of a dead
    agent process (the session back from its snapshot), though the process lived on with its state;
    and a snapshot that raised was that too, where the README promised 422 ``agent_error``."""
    from workers.command import AgentError

    agent = await _agent(pool, "tests.agents.raiser:Raiser")
    try:
        assert await agent.invoke("x") == {"count": 1}
        with pytest.raises(TurnFailed) as e:
            await agent.invoke("boom")
        assert (e.value.code, e.value.status) == ("agent_exception", 500) and "RuntimeError: boom" in e.value.message
        assert not agent.dead
        assert await agent.invoke("arm") == {"count": 2}, "the state lived through the exception"
        with pytest.raises((TurnFailed, AgentError)) as snap:
            await agent.snapshot()
        assert (snap.value.code, snap.value.status) == ("agent_error", 422), snap.value
        assert not agent.dead and await agent.invoke("x") == {"count": 3}
        assert await agent.invoke("list") == {"count": 4}
        with pytest.raises(TurnFailed) as notobj:  # JSON, not an object: refused as well, not a crash
            await agent.snapshot()
        assert (notobj.value.code, notobj.value.status) == ("agent_error", 422) and "list" in notobj.value.message
        assert not agent.dead and await agent.invoke("x") == {"count": 5}
    finally:
        await _done(pool, agent)


def test_periodic_snapshots_that_keep_failing_back_off() -> None:
    from workers.server import _SNAPSHOT_RETRY_MAX_S, snapshot_due

    assert not snapshot_due(100.0, 0, 2.0, 101.9) and snapshot_due(100.0, 0, 2.0, 102.0)
    assert not snapshot_due(100.0, 1, 2.0, 103.9) and snapshot_due(100.0, 1, 2.0, 104.0)  # 2 x
    assert not snapshot_due(100.0, 3, 2.0, 115.9) and snapshot_due(100.0, 3, 2.0, 116.0)  # 8 x
    assert snapshot_due(100.0, 99, 2.0, 100.0 + _SNAPSHOT_RETRY_MAX_S)  # capped
    assert not snapshot_due(100.0, 99, 600.0, 100.0 + _SNAPSHOT_RETRY_MAX_S), "never below the interval"
