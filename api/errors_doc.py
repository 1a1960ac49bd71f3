"""Every error code the public API answers with: status and meaning (the OpenAPI ``Error`` schema's enum
and the README's error list are built from this table; a test checks that each code raised in the public
API's modules is listed here)."""

from __future__ import annotations

from typing import Any

#: code -> (HTTP status, meaning)
ERROR_CODES: dict[str, tuple[int, str]] = {
    "bad_json": (400, "the body is not valid JSON (also a body that is not UTF-8 or starts with a byte order mark)"),
    "missing_input": (400, "invoke body lacks the `input` field"),
    "bad_request": (400, "a malformed request"),
    "unsupported_template": (400, "a create of a template with only `spec.container`: workers run an agent's "
                                  "`spec.entrypoint` or `spec.command`"),
    "unauthorized": (401, "no, unknown or revoked credentials (API key or JWT)"),
    "invalid_token": (401, "a JWT that fails verification (signature, issuer, audience, unknown key)"),
    "token_expired": (401, "an expired JWT"),
    "jwks_unavailable": (401, "the OIDC issuer's keys could not be fetched to verify the JWT"),
    "forbidden": (403, "an admin-only request (e.g. another tenant's listing) by a non-admin"),
    "no_tenant": (403, "a valid JWT without a usable tenant claim"),
    "host_not_allowed": (403, "open mode (no credentials) on a loopback address: the `Host` header names another "
                         "host (a web page reaching the API by DNS rebinding); `SUBSTRATE_API__ALLOWED_HOSTS` "
                         "adds names"),
    "cross_origin_request": (403, "a state-changing call a browser sent from another site or origin "
                                  "(`Sec-Fetch-Site`, `Origin`): a web page may not drive the API"),
    "not_found": (404, "no such route"),
    "session_not_found": (404, "no such session, or it belongs to another tenant (same answer on purpose); to a "
                               "turn under way, its session's record vanished without a delete (the directory's "
                               "Redis lost its data)"),
    "method_not_allowed": (405, "wrong HTTP method; the `Allow` header lists the path's methods"),
    "request_timeout": (408, "the body did not arrive within `api.body_read_timeout_s` of the request's headers, "
                             "or the headers within `api.header_read_timeout_s` of its first byte; "
                             "the connection is closed"),
    "headers_too_large": (431, "a request line and headers over 64 KiB (`substrate.serving.MAX_HEADER_BYTES`); "
                               "the connection is closed"),
    "session_exists": (409, "the client-chosen session ID is taken"),
    "invalid_state": (409, "the session is not in a state that allows the call"),
    "conflict": (409, "the session changed concurrently (e.g. a suspend met a concurrent resume); retry"),
    "store_taken": (409, "`POST /v1/snapshotstore/adopt` on a store whose marker is another directory's (another "
                         "runtime or key prefix uses it): nothing written"),
    "payload_too_large": (413, "the body is over `api.max_body_bytes`"),
    "unsupported_transfer_encoding": (501, "a `Transfer-Encoding` other than `chunked` (e.g. `gzip, chunked`): "
                                           "send the body with `Content-Length`, or `chunked` only"),
    "http_version_not_supported": (505, "a request line of another major HTTP version than 1 (e.g. `HTTP/2.0` "
                                        "as text): send HTTP/1.1"),
    "unsupported_media_type": (415, "a body sent without `Content-Type: application/json` (none, or e.g. curl's "
                                    "default `application/x-www-form-urlencoded`): send that header"),
    "invalid_input": (422, "the body or a parameter fails validation (also invoke's `stream=` other than `1`, "
                           "`true`, `0`, `false`, an unknown body field, invoke's top level included, a query "
                           "parameter given twice, or a list's `limit=` that is not 1-1000 in plain decimal "
                           "digits, e.g. `1.0`)"),
    "invalid_session_id": (422, "a malformed session ID"),
    "unknown_template": (422, "no such ActorTemplate"),
    "unknown_pool": (422, "the template names a WorkerPool that does not exist"),
    "unknown_worker": (422, "resume pinned to a worker that is not registered"),
    "invalid_continue": (422, "a `continue` token not made by this API"),
    "invalid_tenant": (422, "a `tenant=` that is no tenant name (1-63 lower-case letters, digits and '-', starting and ending with a letter or digit; also an "
                            "empty `tenant=`)"),
    "invalid_idempotency_key": (422, "an `Idempotency-Key` that is empty, over 200 characters, sent twice, or not "
                                     "printable ASCII"),
    "invalid_request_id": (422, "an `X-Request-ID` that is not 1-128 visible ASCII characters"),
    "idempotency_key_reused": (422, "the `Idempotency-Key` (without one, the `X-Request-ID`) was used before for a "
                                    "turn with another body"),
    "workspace_too_large": (422, "suspend/snapshot refused: the workspace's apparent bytes exceed the template's "
                                 "`isolation.maxDiskBytes` (sparse files count in full) or it has too many files; "
                                 "the session keeps running"),
    "workspace_name_too_long": (422, "suspend/snapshot refused: a path in the workspace is longer than a restore "
                                     "accepts; the session keeps running"),
    "workspace_unreadable": (422, "suspend/snapshot refused: a workspace file could not be read; the session "
                                  "keeps running"),
    "agent_error": (422, "the agent refused the input"),
    "invalid_env": (422, "a session env variable the policy refuses (name in `details.name`; see README Security model)"),
    "output_too_large": (422, "the turn's answer (or a streamed chunk) is over the worker's `max_answer_bytes` "
                              "(16 MiB); the agent goes on"),
    "answer_not_kept": (410, "a retried turn (same `Idempotency-Key`) that already ran, whose answer was too big to "
                             "keep (`worker.answer_keep_bytes`); the turn is not run again"),
    "session_deleted": (410, "the session was deleted while this turn was under way: the delete stopped the turn "
                             "(the outcome of its side effects is unknown) and the session is gone; to a create, "
                             "the session it made was deleted while it started"),
    "state_load_failed": (422, "the session's saved state cannot be loaded by its agent (`details.exception` names "
                               "what the load raised); the session is FAILED with its snapshot kept, DELETE works, "
                               "the tenant's breaker does not count it"),
    "state_too_large": (422, "suspend/snapshot refused: the agent's state does not fit the template's limits (the "
                             "message names the limit, e.g. `isolation.maxDiskBytes`); the session keeps running "
                             "with all its state"),
    "memory_limit_exceeded": (422, "the session went over `isolation.maxMemory`; its agent restarts from its last "
                                   "snapshot (at a create or wake: the agent cannot start within it)"),
    "secret_unavailable": (422, "a credential the template asks for cannot be resolved for this tenant"),
    "quota_max_running": (429, "the tenant (or the tenant's template) holds its maximum of live sessions"),
    "quota_max_total": (429, "the tenant (or template) has its maximum number of sessions; only deleting "
                             "one makes room, so there is no `Retry-After`"),
    "quota_max_gpus": (429, "live sessions of the tenant (or template) hold its maximum of GPUs"),
    "quota_max_creates_per_minute": (429, "the tenant (or template) created its maximum in the last minute"),
    "tenant_parked_share": (429, "the tenant's requests already fill their share of waiting places"),
    "tenant_circuit_open": (429, "the tenant's recent activations of this template kept failing; that breaker is open"),
    "agent_crashed": (500, "the agent's process died or broke its protocol (e.g. an answer that is not "
                           "JSON): that activation ends and the session comes back from its last snapshot; "
                           "its answers say so (`X-Substrate-Restored: agent_restarted`)"),
    "agent_exception": (500, "the agent's code raised an exception in the turn (or answered an error a turn "
                             "cannot have); its process lives on: the session keeps its state and epoch"),
    "agent_start_failed": (500, "the agent failed to start"),
    "agent_protocol_violation": (500, "the agent wrote a protocol line that does not answer the worker's current "
                                      "request (e.g. agent code writing to the agent host's pipe); it was killed "
                                      "and the session restarts from its last snapshot"),
    "activation_failed": (500, "the worker could not set up the activation (logged on the worker)"),
    "snapshot_corrupt": (500, "the snapshot failed verification; the session is FAILED, next call uses the previous one"),
    "checkpoint_failed": (500, "a process checkpoint of the agent failed (suspend keeps it RUNNING)"),
    "internal": (500, "an unexpected error"),
    "checkpoint_unsupported": (501, "the template asks for process checkpoints this worker cannot take"),
    "worker_unavailable": (502, "the worker died mid-request; the session resumes from its last snapshot"),
    "session_moving": (502, "the session kept moving between workers; retry"),
    "invoke_timeout": (502, "the worker did not answer within `api.invoke_timeout_s`"),
    "turn_timeout": (504, "the turn ran over `isolation.turnTimeout`; the session's processes were killed"),
    "no_capacity": (503, "no free slot; retry after `Retry-After`. `details.reason`, when the pool cannot grow "
                         "now: `no_replicas`, `unschedulable`, `start_backoff` (its workers fail in a row) or "
                         "`activations_saturated`"),
    "directory_unavailable": (503, "Redis is unreachable"),
    "no_signing_key": (503, "the activation-token signing keys are not loaded yet (a runtime starting, or its Redis "
                            "lost its data); retry after `Retry-After`"),
    "snapshot_store_unavailable": (503, "object storage is unreachable"),
    "resume_timeout": (503, "the session's restore did not end within `api.park_timeout_s` (plus `api.restore_s_per_file` for each file of its snapshot) of its placement (a wait for a slot or a permit before it is bounded by `api.start_wait_s`)"),
    "worker_fenced": (503, "the worker chosen was past its own lease; the router placed the call on other workers and they were fenced too; retry"),
    "too_many_parked": (503, "too many requests wait for resumes in this router"),
    "no_workers": (503, "/readyz: a pool lacks its ready workers"),
    "router_stopping": (503, "the router stopped (its graceful-shutdown time ran out) before the call's answer came; "
                             "the turn may have run: retry with the same `Idempotency-Key`"),
    "suspend_timeout": (503, "the object store was slower than the transition deadline; the session stays RUNNING"),
}


#: the error statuses each public route can answer, as its OpenAPI ``responses`` list them (every ``/v1``
#: route can answer 401/403 (credentials), 422 (``invalid_request_id``) and 503 (``directory_unavailable``);
#: the activating routes the worker's answers as well). A route not listed gets ``DEFAULT_STATUSES``.
_V1 = (401, 403, 422, 503)
_BODY = (400, 408, 413, 415)  # the JSON-body routes
_ACTIVATES = (409, 429, 500, 501, 502)  # routes that may place and start an activation
ROUTE_STATUSES: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/v1/sessions"): (*_V1, *_BODY, *_ACTIVATES),
    ("get", "/v1/sessions"): _V1,
    ("get", "/v1/sessions/{sid}"): (*_V1, 404),
    ("delete", "/v1/sessions/{sid}"): (*_V1, 404, 409),
    ("post", "/v1/sessions/{sid}/invoke"): (*_V1, *_BODY, *_ACTIVATES, 404, 410, 504),
    ("post", "/v1/sessions/{sid}/suspend"): (*_V1, *_BODY, 404, 409, 500, 502),  # it takes {} or null
    ("post", "/v1/sessions/{sid}/resume"): (*_V1, *_BODY, *_ACTIVATES, 404),
    ("get", "/v1/sessions/{sid}/events"): (*_V1, 404),
    ("get", "/v1/events"): _V1,
    ("get", "/v1/workerpools"): _V1,
    ("get", "/v1/actortemplates"): _V1,
    ("get", "/v1/stats"): _V1,
    ("get", "/v1/snapshotstore"): _V1,
    ("post", "/v1/snapshotstore/adopt"): (*_V1, *_BODY, 409),
    ("get", "/readyz"): (503,),
}
DEFAULT_STATUSES: tuple[int, ...] = _V1


def openapi_error_schema() -> dict[str, Any]:
    """The ``Error`` component schema: code (enum of every code, with its status and meaning), message."""
    lines = "\n".join(f"- `{c}` ({st}): {m}" for c, (st, m) in ERROR_CODES.items())
    return {"type": "object", "required": ["code", "message"],
            "description": "Every error answer. Codes:\n\n" + lines,
            "properties": {"code": {"type": "string", "enum": list(ERROR_CODES)},
                           "message": {"type": "string"},
                           "details": {"type": "object", "additionalProperties": True}}}


def responses_for(*statuses: int) -> dict[str, Any]:
    """OpenAPI ``responses`` entries for ``statuses``, each listing its codes and pointing at ``Error``."""
    out: dict[str, Any] = {}
    for st in statuses:
        codes = [c for c, (s, _) in ERROR_CODES.items() if s == st]
        out[str(st)] = {"description": ", ".join(f"`{c}`" for c in codes) or "error",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        if st in (429, 503):
            out[str(st)]["headers"] = {"Retry-After": {
                "schema": {"type": "integer"},
                "description": "seconds to wait before retrying; absent when waiting cannot help "
                               "(`quota_max_total`, a quota of 0)" if st == 429 else
                               "seconds to wait before retrying"}}
    return out
