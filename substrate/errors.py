"""The exception tree of the runtime: every error carries a stable ``code`` and an HTTP ``status``.

Adapters translate foreign errors (redis, botocore, aiohttp) into these (``raise X(...) from e``); the API
renders them as ``{"code", "message", "details"}`` JSON with the status, adding ``Retry-After`` where
``retry_after_s`` is set. Style after kopf's ``TemporaryError``/``PermanentError`` split.
"""

from __future__ import annotations

import json
import re
from typing import Any

#: how much of a client's input an error message echoes back (a 20 KB ID is not sent back whole)
ECHO_LIMIT = 64


def clip(value: object, limit: int = ECHO_LIMIT, *, quote: bool = True) -> str:
    """``value`` as error messages echo it: cut at ``limit`` characters (then ``...`` and its full length),
    quoted with ``repr`` (``quote``) or else with unprintable characters escaped; never a lone surrogate."""
    text = value if isinstance(value, str) else str(value)
    cut = len(text) > limit
    head = text[:limit] if cut else text
    out = repr(head) if quote else head.encode("utf-8", "backslashreplace").decode("utf-8")
    return f"{out}... ({len(text)} characters)" if cut else out


#: what of an internal failure's text would tell a tenant how the deployment is laid out: URLs (an S3
#: endpoint, a worker's address), IP addresses, host:port pairs and socket address tuples (Redis), absolute file paths (a
#: worker's folders, a local store's root). Absolute paths are a "/" not after a word character, "/",
#: ":" or "." (so "I/O", "1/2" and relative object keys stay)
_INTERNAL = re.compile(
    r"\('[^']*', \d+(?:, \d+, \d+)?\)"  # a socket address as Python prints it: ('10.0.0.3', 6379)
    # a URL; a sentence's "," ";" after it stays, and so does a "." ":" "!" "?" that ends it (``{url}: why``
    # lost its colon, a tester 54 finding)
    r"|[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>(),;]*[^\s'\"<>(),;.:!?]"
    r"|\[[0-9A-Fa-f:.]+\](?::\d+)?"  # [IPv6]:port
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"  # IPv4[:port]
    r"|\b(?:localhost|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+):\d{1,5}\b"  # host:port
    r"|(?<![\w/:.])/[^\s'\",;()<>]*[^\s'\",;()<>.:!?]"  # an absolute path (the same end as a URL's)
)


#: codes of failures of the runtime's own parts (Redis, the snapshot store, a worker, a bug): their
#: messages reach clients through ``hide_internal`` (``SubstrateError.to_dict``)
INFRA_CODES = frozenset({"directory_unavailable", "snapshot_store_unavailable", "worker_unavailable",
                         "worker_error", "activation_failed", "internal"})


def hide_internal(text: str) -> str:
    """``text`` with every URL, address (``host:port``, IPv4, IPv6, a socket address tuple) and absolute
    path put as ``<internal>`` (see ``public_detail``)."""
    return _INTERNAL.sub("<internal>", text)


def public_detail(e: BaseException, limit: int = 200) -> str:
    """``e`` as an error message to a client may name it: its class and text, with every URL, address
    (``host:port``, IPv4, IPv6) and absolute path put as ``<internal>``, cut at ``limit`` characters.
    For a foreign failure inside the runtime (Redis, S3, a worker's disk) whose text a tenant gets in a
    5xx: what failed and how is the client's to know, where the deployment's parts are not (a fresh-user
    run read the Redis address, a worker's address and its folders in 503s). The whole text stays in the
    exception chain (``raise ... from e``) and the logs."""
    text = str(e)
    detail = f"{e.__class__.__name__}: {hide_internal(text)}" if text else e.__class__.__name__
    return detail if len(detail) <= limit else detail[:limit] + "..."


#: the one encoder of every error body (router, front door, worker, header timeout): compact, as FastAPI
#: writes its own answers (``{"code":"x","message":"y"}``, no spaces), and ASCII (other characters
#: escaped), so no message can hold bytes that are not UTF-8. A module-level encoder: ``json.dumps`` with
#: ``separators`` would build one per call
_ERROR_ENCODER = json.JSONEncoder(separators=(",", ":"))


def error_json(doc: Any) -> str:
    """``doc`` (an error body, ``{"code","message"[,"details"]}``, or a stream's ``{"error": ...}`` line)
    in the one format every error of the API has: compact JSON, ASCII only."""
    return _ERROR_ENCODER.encode(doc)


class SubstrateError(Exception):
    """Base class. ``status`` is the HTTP status the API answers with; ``code`` is stable for clients."""

    status: int = 500
    code: str = "internal"
    retry_after_s: float | None = None

    def __init__(self, message: str, *, code: str | None = None, details: dict[str, Any] | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code:
            self.code = code
        self.details = details or {}
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s

    def to_dict(self) -> dict[str, Any]:
        """The error's body, ``{"code", "message"[, "details"]}``. An error of ``INFRA_CODES`` is a failure
        of the runtime's own parts: its message goes out with every address, URL and absolute path as
        ``<internal>`` (``hide_internal``), wherever it was raised (fresh-user tester 37: a missing
        snapshot's 503 named ``s3://bucket/prefix`` and a local store's folder); the exception keeps the
        whole text. Other errors keep theirs: an agent's failure to start names the template's own
        command and the sandbox's folders, which are the tenant's to know."""
        message = hide_internal(self.message) if self.code in INFRA_CODES else self.message
        body: dict[str, Any] = {"code": self.code, "message": message}
        if self.details:
            body["details"] = self.details
        return body

    def to_json(self) -> bytes:
        """The error's body as the API sends it (``error_json`` of ``to_dict``)."""
        return error_json(self.to_dict()).encode()


class InvalidInput(SubstrateError):
    status, code = 422, "invalid_input"


class BadRequest(SubstrateError):
    status, code = 400, "bad_request"


class Unauthorized(SubstrateError):
    status, code = 401, "unauthorized"


class NotFound(SubstrateError):
    status, code = 404, "not_found"


class Conflict(SubstrateError):
    status, code = 409, "conflict"


class StaleEpoch(Conflict):
    """A call carried an activation epoch older than the current one (DESIGN invariant 1)."""

    code = "stale_epoch"


class PayloadTooLarge(SubstrateError):
    status, code = 413, "payload_too_large"


class UnsupportedMediaType(SubstrateError):
    """A body sent with a ``Content-Type`` the route does not read (JSON routes: not JSON)."""

    status, code = 415, "unsupported_media_type"


class TemporaryError(SubstrateError):
    """Retry later: the answer is 503 with ``Retry-After``."""

    status, code = 503, "unavailable"
    retry_after_s = 1.0


class NoCapacity(TemporaryError):
    code = "no_capacity"


class DirectoryUnavailable(TemporaryError):
    code = "directory_unavailable"


def script_failure(e: BaseException) -> SubstrateError | None:
    """For a Redis error that is one of our Lua scripts failing as it ran (Redis names the place
    ``user_script:<line>``): a bug of ours, 500 ``internal``, not an unavailable Redis (a fresh-user run:
    a quota script's arithmetic on nil was answered 503 "Redis unavailable" with ``Retry-After: 1``, and
    would have marked the directory unavailable). None for any other error."""
    text = str(e)
    # Redis refusing writes (a script's write included) for a reason of its own: its disk is full or
    # failing (MISCONF), it is out of memory (OOM), it is a replica (READONLY): unavailable, not a bug
    # (fresh-user round 15: a full disk under the AOF answered 500 ``internal`` "a bug")
    if "user_script:" not in text or any(w in text for w in ("MISCONF", "OOM command", "READONLY", "NOREPLICAS")):
        return None
    return SubstrateError(f"a session directory script failed (a bug, not an unavailable Redis): {e}")


class StoreUnavailable(TemporaryError):
    code = "snapshot_store_unavailable"


class TooManyParked(TemporaryError):
    code = "too_many_parked"


class ResumeTimeout(TemporaryError):
    code = "resume_timeout"


class WorkerUnavailable(SubstrateError):
    """The worker hosting the session died or stopped answering mid-request. ``reached`` is False when
    the call never got to the worker (its connection was refused): nothing ran there, so the caller may
    place the same work on another worker."""

    status, code = 502, "worker_unavailable"
    reached = True


class SnapshotCorrupt(SubstrateError):
    """A snapshot failed its checksum, was truncated, or belongs to another session."""

    status, code = 500, "snapshot_corrupt"


class StateLoadFailed(SubstrateError):
    """The agent host reported that the session's restored state itself cannot be loaded (e.g. a
    notebook variable whose unpickling ends the process). The session's own fault: the wake answers 422,
    the session goes to FAILED with its snapshot kept, and the tenant's circuit breaker does not count
    it. ``details["exception"]`` names what the load raised."""

    status, code = 422, "state_load_failed"


class SessionFailed(SubstrateError):
    status, code = 409, "session_failed"


class SessionDeleted(SubstrateError):
    """The session was deleted while the call was under way (a turn in flight is stopped by the delete)."""

    status, code = 410, "session_deleted"


class TooManyRequests(SubstrateError):
    """429 with ``Retry-After``: a quota, a fairness share or a tenant's circuit breaker said no. The
    ``code`` names the limit (``quota_max_running``, ``quota_max_total``, ``quota_max_gpus``,
    ``quota_max_creates_per_minute``, ``tenant_parked_share``, ``tenant_circuit_open``). A limit that
    waiting cannot clear (``quota_max_total``, any limit of 0) sets ``retry_after_s`` to None: no header."""

    status, code = 429, "too_many_requests"
    retry_after_s = 1.0


class Forbidden(SubstrateError):
    status, code = 403, "forbidden"
