"""Client of the workers' internal HTTP API (see ``workers/server.py``), over one pooled aiohttp session.

Errors come back as our own: a worker that cannot be reached becomes ``WorkerUnavailable`` (502); an
error answer is rebuilt from its ``code`` (``stale_epoch`` -> ``StaleEpoch``, ``snapshot_corrupt`` ->
``SnapshotCorrupt`` ...), so callers branch on types, not on status numbers.

Every call carries a per-activation token (``substrate.tokens``) bound to the session, its epoch, the
worker's address and the tenant, minted here from the shared signing-key ring.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from substrate import errors as E
from substrate.models import ActorTemplate, SnapshotRef
from substrate.tokens import TokenMinter

log = logging.getLogger(__name__)

EPOCH_HEADER = "X-Substrate-Epoch"
IDEMPOTENCY_HEADER = "Idempotency-Key"
#: value ``router``: the turn's idempotency key is a request ID the router made (the client sent neither
#: ``Idempotency-Key`` nor ``X-Request-ID``); the worker lets such answers make room first
KEY_ORIGIN_HEADER = "X-Substrate-Key-Origin"
#: how long ending an activation may take on a live worker (s): its agent's stop, sandbox and slot clean-up
DEACTIVATE_TIMEOUT_S = 10.0

_BY_CODE: dict[str, type[E.SubstrateError]] = {
    "stale_epoch": E.StaleEpoch, "not_active": E.NotFound, "snapshot_corrupt": E.SnapshotCorrupt,
    "snapshot_store_unavailable": E.StoreUnavailable, "no_capacity": E.NoCapacity,
    "busy": E.Conflict, "invalid_state": E.Conflict, "directory_unavailable": E.DirectoryUnavailable,
    "state_load_failed": E.StateLoadFailed,
}


def error_from(status: int, body: Any, retry_after: str | None = None) -> E.SubstrateError:
    """Rebuild a ``SubstrateError`` from a worker's error answer (status, parsed JSON body, its
    ``Retry-After`` header). A numeric ``details.retry_after_s`` (0 < s <= 3600) becomes the error's
    ``Retry-After``; else the worker's header does, for an error whose class has none (tester 37: the
    worker's 503 ``suspend_timeout`` said ``Retry-After: 1``, the router's answer said nothing)."""
    code = body.get("code", "worker_error") if isinstance(body, dict) else "worker_error"
    message = body.get("message", str(body)) if isinstance(body, dict) else str(body)
    cls = _BY_CODE.get(code, E.SubstrateError)
    details = body.get("details") if isinstance(body, dict) else None
    err = cls(message, code=code, details=details if isinstance(details, dict) else None)
    hint = err.details.get("retry_after_s")  # a wait the worker knows better than the default (a grace)
    if isinstance(hint, (int, float)) and not isinstance(hint, bool) and 0 < hint <= 3600:
        err.retry_after_s = float(hint)
    elif err.retry_after_s is None and retry_after is not None and retry_after.strip().isdigit() \
            and 0 < int(retry_after) <= 3600:
        err.retry_after_s = float(int(retry_after))
    if cls is E.SubstrateError:
        err.status = status if status >= 400 else 502
    return err


def token_refused_error(address: str, body: Any) -> E.WorkerUnavailable:
    """What a caller is told when a worker refuses the control plane's activation token (401): the
    refusal is between the router and the worker, never about the client's own credentials (it reached
    clients as 401 ``invalid_token`` with ``WWW-Authenticate``, as if their key were bad: a fresh-user run
    after a Redis flush). 502 ``worker_unavailable``, retryable."""
    why = body.get("message", "") if isinstance(body, dict) else str(body)
    log.warning("a worker refused this router's activation token", extra={"worker_address": address,
                                                                           "why": str(why)[:200]})
    return E.WorkerUnavailable(f"the session's worker refused this router's activation token "
                               f"({str(why)[:200]}); retry", code="worker_unavailable", retry_after_s=1)


def _call_headers(token: str, epoch: int | None) -> dict[str, str]:
    """The headers that bind a call to its activation: the token, and the epoch it names."""
    h = {"Authorization": f"Bearer {token}"}
    if epoch is not None:
        h[EPOCH_HEADER] = str(epoch)
    return h


class WorkerClient:
    """Calls one of many workers by address. One instance per process (it owns the connection pool)."""

    def __init__(self, minter: TokenMinter, *, timeout_s: float = 300.0, connect_timeout_s: float = 2.0) -> None:
        self.minter = minter
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        #: ``auth_head``'s encoded header lines by token
        self._heads: dict[str, bytes] = {}
        self.max_cached_heads = 100_000

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, keepalive_timeout=60),
                timeout=self._timeout, auto_decompress=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def auth_headers(self, address: str, session: str, epoch: int | None, tenant: str = "") -> dict[str, str]:
        """Headers for one call to the worker at ``address`` on ``session`` at ``epoch``."""
        token = self.minter.mint(session=session, epoch=epoch, worker_address=address, tenant=tenant)
        return _call_headers(token, epoch)

    def auth_head(self, address: str, session: str, epoch: int | None, tenant: str = "") -> bytes:
        """``auth_headers`` as HTTP/1.1 header lines, each preceded by CRLF (``b"\\r\\nAuthorization:
        Bearer ...\\r\\nX-Substrate-Epoch: 3"``), for a client that writes its request itself (the
        router's hot path, ``api.workerhttp``). Kept encoded per token: the minter reuses a token per
        binding (session, epoch, worker, tenant) for half its life, and the token names the epoch, so a
        turn costs a dict lookup where it built and encoded the headers (bounded: cleared past
        ``max_cached_heads``)."""
        token = self.minter.mint(session=session, epoch=epoch, worker_address=address, tenant=tenant)
        head = self._heads.get(token)
        if head is None:
            if len(self._heads) >= self.max_cached_heads:
                self._heads.clear()
            lines = "".join(f"\r\n{k}: {v}" for k, v in _call_headers(token, epoch).items())
            head = self._heads[token] = lines.encode("latin-1")
        return head

    async def _call(self, method: str, url: str, *, address: str, session: str, epoch: int | None = None,
                    tenant: str = "", json_body: Any = None, params: dict[str, str] | None = None,
                    timeout_s: float | None = None) -> Any:
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else None
        for attempt in (1, 2):
            headers = self.auth_headers(address, session, epoch, tenant)
            try:
                async with self.session.request(method, url, json=json_body, headers=headers, params=params,
                                                timeout=timeout or self._timeout) as resp:
                    if resp.status == 204:
                        return None
                    try:
                        body = await resp.json(content_type=None)
                    except (ValueError, aiohttp.ContentTypeError):
                        body = {"code": "worker_error", "message": (await resp.text())[:500]}
                    if resp.status == 401:  # the worker refused this process's token: nothing ran there
                        if attempt == 1 and await self.token_refused():
                            continue
                        raise token_refused_error(address, body)
                    if resp.status >= 400:
                        raise error_from(resp.status, body, resp.headers.get("Retry-After"))
                    return body
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as e:
                err = E.WorkerUnavailable(f"the session's worker did not answer: {E.public_detail(e)}")
                err.reached = not isinstance(e, aiohttp.ClientConnectorError)  # refused: nothing was sent
                raise err from e
        raise AssertionError("unreachable")

    async def token_refused(self) -> bool:
        """A worker answered 401 to this process's activation token (its ring lacks the key: keys written
        back after a Redis data loss, a worker started meanwhile with a key of its own): reload the
        signing keys; True if the current key changed, so that a call made again is signed otherwise."""
        before = self.minter.ring.current
        try:
            await self.minter.ring.refresh_if_stale(0.0)
        except E.SubstrateError:
            return False
        return self.minter.ring.current != before

    async def activate(self, address: str, *, session: str, epoch: int, template: ActorTemplate, slot: int,
                       env: dict[str, str], snapshot: SnapshotRef | None,
                       restored: str | None = None, tenant: str = "default",
                       answers: list[list[Any]] | None = None,
                       restored_at: float | None = None) -> dict[str, Any]:
        """Start or restore an activation. ``restored``: why older state comes back (``worker_lost``
        ...), sent on every answer of the activation as ``X-Substrate-Restored``; ``restored_at``: with
        it, the time (Unix s) the restored state dates from when that is not the snapshot's own
        ``createdAt`` (the record's ``lostAfter``; 0: no state came back), sent as
        ``X-Substrate-Restored-Snapshot-At``; ``answers``: the
        record's ``carriedAnswers`` (kept by idempotency key next to the snapshot's). Raises
        SnapshotCorrupt, StoreUnavailable, NoCapacity, StaleEpoch, WorkerUnavailable."""
        return await self._call("POST", f"{address}/v1/activations", address=address, session=session,
                                epoch=epoch, tenant=tenant, json_body={
            "session": session, "epoch": epoch, "template": template.name,
            "spec": template.spec.model_dump(mode="json", exclude_none=True), "slot": slot, "env": env,
            "snapshot": snapshot.model_dump() if snapshot else None, "restored": restored,
            **({"restoredAt": restored_at} if restored and restored_at is not None else {}),
            **({"answers": answers} if answers else {})})

    async def suspend(self, address: str, session: str, epoch: int, *, idle_s: float | None = None,
                      wait_s: float | None = None, tenant: str = "", reason: str = "explicit") -> SnapshotRef:
        """Suspend ``session`` on its worker. ``idle_s``: only if idle that long (an idle or pressure
        suspend never waits for a turn); ``wait_s``: wait at most that long for a running turn to end,
        else ``Conflict`` (``busy``); neither: wait for the turn (a drain). ``reason`` (one of
        ``models.SUSPEND_REASONS``) becomes the record's ``suspendReason``."""
        params = {"idle_s": repr(idle_s)} if idle_s is not None else {}
        params["reason"] = reason
        if wait_s is not None:
            params["wait_s"] = repr(wait_s)
        body = await self._call("POST", f"{address}/v1/activations/{session}/suspend", address=address,
                                session=session, epoch=epoch, tenant=tenant, params=params)
        return SnapshotRef.model_validate(body["snapshot"])

    async def snapshot(self, address: str, session: str, epoch: int) -> SnapshotRef:
        body = await self._call("POST", f"{address}/v1/activations/{session}/snapshot", address=address,
                                session=session, epoch=epoch)
        return SnapshotRef.model_validate(body["snapshot"])

    async def deactivate(self, address: str, session: str, epoch: int | None = None) -> None:
        """End an activation (``DELETE /v1/activations/{session}``), waiting at most ``DEACTIVATE_TIMEOUT_S``."""
        await self._call("DELETE", f"{address}/v1/activations/{session}", address=address, session=session,
                         epoch=epoch, timeout_s=DEACTIVATE_TIMEOUT_S)

    async def healthy(self, address: str, timeout_s: float = 0.5) -> bool:
        """True if the worker answers ``/healthz`` with 200 within ``timeout_s``."""
        try:
            async with self.session.get(f"{address}/healthz",
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False
