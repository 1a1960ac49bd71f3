"""Settings for every component, in one pydantic-settings tree.

Read from environment variables prefixed ``SUBSTRATE_`` with ``__`` between nesting levels
(``SUBSTRATE_API__PORT=8080``, ``SUBSTRATE_SNAPSHOT__STORE=s3``). ``SUBSTRATE_REDIS_URL`` is accepted
as a short alias for ``SUBSTRATE_REDIS__URL`` because it is the one setting almost every user sets.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from substrate.models import QuotaLimits


class RedisSettings(BaseModel):
    """Where the directory lives. ``url=None`` means: start an embedded Redis server."""

    url: str | None = None
    key_prefix: str = "substrate"
    socket_timeout_s: float = 2.0


class ApiSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 1 * 1024 * 1024
    #: how long a request for a SUSPENDED session may wait for its resume
    park_timeout_s: float = 5.0
    #: cap on requests parked at once in one router process
    max_parked: int = 1000
    #: how long a request waits for a free slot before 503 (0 = answer at once)
    slot_wait_s: float = 2.0
    #: under slot pressure, only sessions idle at least this long are suspended to make room
    pressure_min_idle_s: float = 1.0
    #: Retry-After sent with 503 answers
    retry_after_s: int = 1
    #: how often the router refreshes its view of registered workers
    worker_refresh_s: float = 0.5
    #: proxied call timeout (a turn may run long)
    invoke_timeout_s: float = 300.0
    #: optional bearer token; when set every /v1 call must carry it
    auth_token: str | None = None


class WorkerSettings(BaseModel):
    host: str = "127.0.0.1"
    heartbeat_s: float = 1.0
    lease_s: float = 5.0
    #: a slot counts as active (demand for the autoscaler) while its session is mid-turn or had a turn
    #: within this window; idle sessions beyond it are evictable capacity (lazy suspension)
    active_window_s: float = 2.0
    root_dir: Path = Path("var/workers")


class ApiKeySpec(BaseModel):
    """One API key given by file or env: its ``sha256`` (hex; preferred) or the ``key`` itself."""

    tenant: str
    sha256: str | None = None
    key: str | None = None
    admin: bool = False
    name: str = ""


class AuthSettings(BaseModel):
    """Who may call the API (see README "Security model"). With no key anywhere, no OIDC issuer and no
    ``api.auth_token``, the API is open and every caller is the tenant ``default``."""

    #: API keys from the environment (JSON list of ApiKeySpec), imported into Redis at start-up
    api_keys: list[ApiKeySpec] = Field(default_factory=list)
    #: YAML/JSON file holding a list of ApiKeySpec, imported into Redis at start-up
    api_keys_file: Path | None = None
    #: OIDC issuer URL; when set, JWT bearer tokens are verified against its JWKS
    oidc_issuer: str | None = None
    oidc_audience: str | None = None
    #: JWKS URL (default: discovered from the issuer's /.well-known/openid-configuration)
    oidc_jwks_url: str | None = None
    #: JWT claim naming the tenant, and the claim (list or space-separated string) holding roles
    tenant_claim: str = "tenant"
    roles_claim: str = "roles"
    admin_role: str = "substrate-admin"
    #: how long the JWKS is reused before a background reload (an unknown key ID reloads at once)
    jwks_ttl_s: float = 300.0
    #: safety net only: verified API keys are re-read after this long even without a revocation message
    key_cache_ttl_s: float = 30.0
    #: lifetime of per-activation tokens the control plane presents to workers
    activation_token_ttl_s: float = 300.0
    #: how often routers and workers re-read the activation-token signing keys
    signing_refresh_s: float = 5.0
    #: folder of credentials templates may ask for (``valueFrom.secretKeyRef``): files
    #: ``<dir>/<tenant>/<secret>/<key>`` or ``<dir>/<secret>/<key>`` (a mounted Kubernetes Secret)
    secrets_dir: Path | None = None


class QuotaSettings(BaseModel):
    """Limits per tenant (ActorTemplates add per-class limits in ``spec.quota``) and fairness knobs."""

    #: limits of a tenant not named in ``tenants``
    default: QuotaLimits = Field(default_factory=QuotaLimits)
    #: limits per tenant name (JSON in ``SUBSTRATE_QUOTA__TENANTS``)
    tenants: dict[str, QuotaLimits] = Field(default_factory=dict)
    #: share of ``api.max_parked`` one tenant's parked requests may take (fairness under a full pool)
    tenant_parked_share: float = Field(0.5, gt=0, le=1)
    #: circuit breaker: this many failed activations of one tenant within the window open it ...
    breaker_failures: int = Field(10, ge=1)
    breaker_window_s: float = 60.0
    #: ... for this long: creates and wakes of that tenant get 429 ``tenant_circuit_open``
    breaker_open_s: float = 30.0


class AuditSettings(BaseModel):
    #: records kept per tenant stream and per session stream (approximate trimming, MAXLEN ~)
    max_per_tenant: int = 100_000
    max_per_session: int = 1_000
    #: a deleted session's records stay queryable (by its tenant and admins) this long
    deleted_retention_s: float = 7 * 24 * 3600.0


class SnapshotSettings(BaseModel):
    store: Literal["local", "s3"] = "local"
    local_dir: Path = Path("var/snapshots")
    bucket: str = "agent-snapshots"
    prefix: str = "snapshots"
    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    multipart_threshold_bytes: int = 8 * 1024 * 1024
    #: committed snapshots kept per session (older ones are garbage-collected)
    retention: int = 2
    zstd_level: int = 3
    #: create the bucket at start-up if it is missing (S3 store)
    create_bucket: bool = True


class StateSettings(BaseModel):
    scan_interval_s: float = 1.0
    #: deadline for each transitional state; past it the session is recovered
    transition_deadline_s: float = 60.0
    #: resume a crashed worker's sessions eagerly instead of on the next request
    eager_recovery: bool = False
    suspend_retry_base_s: float = 0.5
    suspend_retry_max_s: float = 30.0


class PoolSettings(BaseModel):
    reconcile_interval_s: float = 1.0
    #: demand must stay below capacity this long before a worker is drained (hysteresis)
    scale_down_delay_s: float = 10.0
    #: a dead local worker process is restarted after this back-off
    restart_backoff_s: float = 0.5


class Settings(BaseSettings):
    """The whole configuration tree. Construct with keyword overrides in tests."""

    model_config = SettingsConfigDict(env_prefix="SUBSTRATE_", env_nested_delimiter="__", extra="ignore")

    redis: RedisSettings = Field(default_factory=RedisSettings)
    api: ApiSettings = Field(default_factory=ApiSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    snapshot: SnapshotSettings = Field(default_factory=SnapshotSettings)
    state: StateSettings = Field(default_factory=StateSettings)
    pool: PoolSettings = Field(default_factory=PoolSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    quota: QuotaSettings = Field(default_factory=QuotaSettings)
    audit: AuditSettings = Field(default_factory=AuditSettings)
    #: folder of ActorTemplate / WorkerPool YAML files for the local mode
    config_dir: Path = Path("examples")
    log_level: str = "INFO"
    log_json: bool = True

    def model_post_init(self, __context: object) -> None:
        short = os.environ.get("SUBSTRATE_REDIS_URL")
        if short and not self.redis.url:
            self.redis.url = short


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Process-wide settings, read once from the environment."""
    return Settings()
