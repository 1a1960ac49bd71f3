"""Internal failures reach tenants without the deployment's layout (fresh-user testers 35/36: a 503 named
the Redis address, a 502 the worker's address, an activation failure a worker's folder)."""

from __future__ import annotations

import socket

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from snapshot.store import _unavailable
from substrate.directory import Directory
from substrate.errors import DirectoryUnavailable, WorkerUnavailable, hide_internal, public_detail
from substrate.workerclient import WorkerClient


@pytest.mark.parametrize(("text", "kept", "hidden"), [
    ("Error 111 connecting to 127.0.0.1:6379. Connection refused.", "Connection refused", "127.0.0.1"),
    ("Error -2 connecting to redis-master.ns.svc.cluster.local:6379. Name or service not known.",
     "Name or service not known", "redis-master"),
    ("Could not connect to the endpoint URL: \"http://10.0.3.4:9000/snapshots/s1/3.tar\"",
     "Could not connect", "10.0.3.4"),
    ("[Errno 2] No such file or directory: '/var/lib/substrate/workers/w1/slots/3/ws'",
     "No such file or directory", "/var/lib"),
    ("connect to [::1]:8081 and localhost:8082 failed", "failed", "8081"),
])
def test_addresses_urls_and_absolute_paths_are_hidden(text: str, kept: str, hidden: str) -> None:
    out = public_detail(OSError(text))
    assert out.startswith("OSError: ") and kept in out and "<internal>" in out
    assert hidden not in out


def test_what_is_not_an_address_stays() -> None:
    text = "I/O error on part 1/2 of sessions/s1/3.tar.zst (ratio 0.5)"
    assert public_detail(ValueError(text)) == f"ValueError: {text}"
    assert public_detail(TimeoutError()) == "TimeoutError"  # an empty text: the class alone
    assert public_detail(ValueError("x" * 500), limit=50).endswith("...")


@pytest.mark.parametrize("text", [
    "the snapshot store s3://agent-snapshots/snapshots: its bucket does not exist",
    "the snapshot store file:///tmp/x/snapshots: its marker is missing",
    "a folder /var/lib/substrate/w1: not writable",
    "written to http://10.0.0.3:9000/b. Then it failed!",
])
def test_the_punctuation_that_ends_a_hidden_url_or_path_stays(text: str) -> None:
    """A sentence's colon or full stop after a URL or path stays (tester 54: ``the snapshot store
    <internal> its bucket does not exist`` lost the colon with the URL)."""
    out = hide_internal(text)
    assert "<internal>:" in out or "<internal>." in out
    assert "/tmp" not in out and "10.0.0.3" not in out and "agent-snapshots" not in out and "/var" not in out


async def test_an_unreachable_redis_is_503_without_its_address() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = Directory(f"redis://127.0.0.1:{port}/0", socket_timeout_s=0.5)
    try:
        with pytest.raises(DirectoryUnavailable) as e:
            await d.ping()
    finally:
        await d.close()
    assert e.value.status == 503 and str(port) not in e.value.message and "127.0.0.1" not in e.value.message
    assert e.value.message.startswith("session directory (Redis) unavailable: ConnectionError")
    assert f":{port}" in str(e.value.__cause__), "the whole text stays in the chain for the logs"


async def test_an_unreachable_worker_is_502_without_its_address() -> None:
    class _Minter:  # the call never gets as far as a worker checking its token
        def mint(self, **_: object) -> str:
            return "token"

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = WorkerClient(_Minter(), connect_timeout_s=0.5)  # type: ignore[arg-type]
    try:
        with pytest.raises(WorkerUnavailable) as e:
            await client.deactivate(f"http://127.0.0.1:{port}", "s1", 1)
    finally:
        await client.close()
    assert e.value.status == 502 and str(port) not in e.value.message and "127.0.0.1" not in e.value.message
    assert e.value.message.startswith("the session's worker did not answer: ClientConnectorError")
    assert e.value.reached is False, "refused: nothing was sent, the caller may place the work elsewhere"


def test_a_store_failure_names_the_failure_not_the_endpoint() -> None:
    err = _unavailable("get", "sessions/s1/3.tar", OSError("Could not connect to http://127.0.0.1:5000/b"))
    assert err.status == 503 and "127.0.0.1" not in err.message
    assert err.message == "snapshot store unavailable during get of 'sessions/s1/3.tar': OSError: Could not connect to <internal>"


def test_a_failure_of_the_runtimes_parts_hides_where_they_are_and_other_errors_keep_their_text() -> None:
    """Tester 37: a missing snapshot's 503 named ``s3://bucket/prefix`` (and a local store's folder), a
    message no ``public_detail`` call covered; the bodies of ``INFRA_CODES`` errors are cleaned where they
    are written. An agent that cannot start names the template's own command: that stays."""
    from substrate.errors import InvalidInput, StoreUnavailable, SubstrateError

    err = StoreUnavailable("snapshot object 'snapshots/s1/1.tar' is missing from s3://b/snapshots; "
                           "or from file:///var/lib/substrate/snapshots")
    body = err.to_dict()
    assert body["message"] == ("snapshot object 'snapshots/s1/1.tar' is missing from <internal>; "
                               "or from <internal>")
    assert "s3://b" in err.message, "the exception (and the log) keeps the whole text"
    assert b"<internal>" in err.to_json()
    assert InvalidInput("path /v1/x is not a route").to_dict()["message"] == "path /v1/x is not a route"
    agent = SubstrateError("command '/opt/x' not found inside the sandbox", code="agent_start_failed")
    assert agent.to_dict()["message"] == "command '/opt/x' not found inside the sandbox"
