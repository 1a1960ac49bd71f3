"""Every error code the public API answers with: status and meaning (the OpenAPI ``Error`` schema's enum
and the README's error list are built from this table; a test checks that each code raised in the public
API's modules is listed here)."""

from __future__ import annotations

from typing import Any

#: code -> (HTTP status, meaning)
ERROR_CODES: dict[str, tuple[int, str]] = {
    "bad_json": (400, "the body is not valid JSON"),
    "missing_input": (400, "invoke body lacks the `input` field"),
    "bad_request": (400, "a malformed request"),
    "unauthorized": (401, "no, unknown or revoked credentials (API key or JWT)"),
    "invalid_token": (401, "a JWT that fails verification (signature, issuer, audience, unknown key)"),
    "token_expired": (401, "an expired JWT"),
    "jwks_unavailable": (401, "the OIDC issuer's keys could not be fetched to verify the JWT"),
    "forbidden": (403, "an admin-only request (e.g. another tenant's listing) by a non-admin"),
    "no_tenant": (403, "a valid JWT without a usable tenant claim"),
    "not_found": (404, "no such route"),
    "session_not_found": (404, "no such session, or it belongs to another tenant (same answer on purpose)"),
    "method_not_allowed": (405, "wrong HTTP method"),
    "session_exists": (409, "the client-chosen session ID is taken"),
    "invalid_state": (409, "the session is not in a state that allows the call"),
    "conflict": (409, "the session changed concurrently; retry"),
    "payload_too_large": (413, "the body is over `api.max_body_bytes`"),
    "invalid_input": (422, "the body or a parameter fails validation"),
    "invalid_session_id": (422, "a malformed session ID"),
    "unknown_template": (422, "no such ActorTemplate"),
    "unknown_pool": (422, "the template names a WorkerPool that does not exist"),
    "unknown_worker": (422, "resume pinned to a worker that is not registered"),
    "invalid_continue": (422, "a `continue` token not made by this API"),
    "invalid_idempotency_key": (422, "an `Idempotency-Key` over 200 characters"),
    "idempotency_key_reused": (422, "the `Idempotency-Key` was used before for a turn with another body"),
    "workspace_too_large": (422, "suspend/snapshot refused: the workspace's apparent bytes exceed the template's "
                                 "`isolation.maxDiskBytes` (sparse files count in full) or it has too many files; "
                                 "the session keeps running"),
    "workspace_name_too_long": (422, "suspend/snapshot refused: a path in the workspace is longer than a restore "
                                     "accepts; the session keeps running"),
    "workspace_unreadable": (422, "suspend/snapshot refused: a workspace file could not be read; the session "
                                  "keeps running"),
    "agent_error": (422, "the agent refused the input"),
    "invalid_env": (422, "a session env variable the policy refuses (name in `details.name`; see README Security model)"),
    "memory_limit_exceeded": (422, "the session went over `isolation.maxMemory`; its agent restarts from its last snapshot"),
    "secret_unavailable": (422, "a credential the template asks for cannot be resolved for this tenant"),
    "quota_max_running": (429, "the tenant (or the tenant's template) holds its maximum of live sessions"),
    "quota_max_total": (429, "the tenant (or template) has its maximum number of sessions"),
    "quota_max_gpus": (429, "live sessions of the tenant (or template) hold its maximum of GPUs"),
    "quota_max_creates_per_minute": (429, "the tenant (or template) created its maximum in the last minute"),
    "tenant_parked_share": (429, "the tenant's requests already fill their share of waiting places"),
    "tenant_circuit_open": (429, "the tenant's recent activations kept failing; its breaker is open"),
    "agent_crashed": (500, "the agent raised an exception in the turn"),
    "agent_start_failed": (500, "the agent failed to start"),
    "activation_failed": (500, "the worker could not set up the activation (logged on the worker)"),
    "snapshot_corrupt": (500, "the snapshot failed verification; the session is FAILED, next call uses the previous one"),
    "checkpoint_failed": (500, "a process checkpoint of the agent failed (suspend keeps it RUNNING)"),
    "internal": (500, "an unexpected error"),
    "checkpoint_unsupported": (501, "the template asks for process checkpoints this worker cannot take"),
    "worker_unavailable": (502, "the worker died mid-request; the session resumes from its last snapshot"),
    "session_moving": (502, "the session kept moving between workers; retry"),
    "invoke_timeout": (502, "the worker did not answer within `api.invoke_timeout_s`"),
    "turn_timeout": (504, "the turn ran over `isolation.turnTimeout`; the session's processes were killed"),
    "no_capacity": (503, "no free slot; retry after `Retry-After`"),
    "directory_unavailable": (503, "Redis is unreachable"),
    "snapshot_store_unavailable": (503, "object storage is unreachable"),
    "resume_timeout": (503, "the session did not resume within `api.park_timeout_s`"),
    "too_many_parked": (503, "too many requests wait for resumes in this router"),
    "no_workers": (503, "/readyz: a pool lacks its ready workers"),
    "suspend_timeout": (503, "the object store was slower than the transition deadline; the session stays RUNNING"),
}


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
            out[str(st)]["headers"] = {"Retry-After": {"schema": {"type": "integer"},
                                                       "description": "seconds to wait before retrying"}}
    return out
