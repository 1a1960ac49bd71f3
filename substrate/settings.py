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


#: the example WorkerPool and ActorTemplates shipped inside the package
EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"


class RedisSettings(BaseModel):
    """Where the directory lives. ``url=None`` means: start an embedded Redis server (persistent: AOF
    in ``data_dir``). A Redis Cluster: ``redis+cluster://host:port/0``."""

    url: str | None = None
    #: data folder of the embedded Redis (append-only file), so a restart keeps every session
    data_dir: Path = Path("var/redis")
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
    #: how long a placement waits for a worker that is being started for its pool (instead of
    #: answering ``no_capacity``); a cold start on a busy machine can take several seconds
    start_wait_s: float = 30.0
    #: under slot pressure, only sessions idle at least this long are suspended to make room
    pressure_min_idle_s: float = 1.0
    #: Retry-After sent with 503 answers
    retry_after_s: int = 1
    #: how often the router refreshes its view of registered workers
    worker_refresh_s: float = 0.5
    #: how many distinct workers may drop one turn after it was sent (reset, crash, lease lost) before the
    #: answer is 502 worker_unavailable (a turn may be what kills its worker); refused connects don't count
    max_lost_worker_retries: int = 3
    #: proxied call timeout (a turn may run long)
    invoke_timeout_s: float = 300.0
    #: optional bearer token; when set every /v1 call must carry it
    auth_token: str | None = None


class WorkerSettings(BaseModel):
    host: str = "127.0.0.1"
    #: optional secret mixed (HMAC-SHA256) into the activation-token signing keys kept in Redis, so that
    #: read access to Redis alone cannot mint tokens workers accept (see ``substrate.tokens``). Set the
    #: same value on every router, controller and worker (on Kubernetes: the Secret
    #: ``substrate-internal-token``); unset in the embedded default (Redis is private to it there).
    internal_token: str | None = None
    heartbeat_s: float = 1.0
    lease_s: float = 5.0
    #: a worker stops serving at its own lease expiry (self-fencing); others may declare it dead and
    #: place its sessions elsewhere only this long after that (room for clock skew and a slow tick)
    lease_grace_s: float = 1.0
    #: how often a worker compares its activations with the directory and frees what it does not own
    reconcile_s: float = 2.0
    #: on SIGTERM (or ``substrate up`` stopping) a worker suspends every session within this bound
    shutdown_grace_s: float = 20.0
    #: answers of recent turns kept per activation (and in its snapshot), by idempotency key
    idempotency_keys: int = 64
    #: a slot counts as active (demand for the autoscaler) while its session is mid-turn or had a turn
    #: within this window; idle sessions beyond it are evictable capacity (lazy suspension)
    active_window_s: float = 2.0
    root_dir: Path = Path("var/workers")
    #: per-slot sandbox uids are claimed in [sandbox_uid_base, sandbox_uid_base + sandbox_uid_span)
    #: with flock files in sandbox_uid_lock_dir (when the worker runs as root); see workers/sandbox.py
    sandbox_uid_base: int = 20000
    sandbox_uid_span: int = 10000
    sandbox_uid_lock_dir: Path = Path("/run/substrate/sandbox-uids")
    #: keep a sandboxed agent host started for up to this many free slots (0: none), so a create does
    #: not pay the spawn (each idle host is a Python process of ~10-15 MiB)
    prestart_hosts: int = 16


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
    #: the state manager's orphan sweep (objects no committed snapshot points at) runs this often
    sweep_interval_s: float = 300.0
    #: an object is deleted by the sweep only after it was found orphaned this long (an upload in
    #: flight is never taken for garbage)
    orphan_min_age_s: float = 900.0


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
    #: the pool shrinks only below the largest size wanted over this window (hysteresis)
    scale_down_delay_s: float = 10.0
    #: window of the activation arrival-rate forecast (creates + wakes per second)
    forecast_window_s: float = 30.0
    #: assumed create-to-READY time of a worker until one was measured
    lead_time_s: float = 0.5
    #: a dead local worker process is restarted after this back-off
    restart_backoff_s: float = 0.5


class KubernetesSettings(BaseModel):
    """The Kubernetes mode (``substrate router|controller`` on a cluster; see docs/kubernetes.md).

    ``api_url`` unset: in-cluster service-account config, else ``~/.kube/config``. Workers get the
    connection settings through their Pod: Redis URL and internal token from Secrets (names below; empty
    name = the value of this process is copied into the Pod as a literal, for tests and dev clusters)."""

    namespace: str = "agent-substrate"
    api_url: str | None = None
    #: a Lease in ``namespace``; standbys take over within ``lease_duration_s`` of the leader's last renewal
    lease_name: str = "substrate-controller"
    lease_duration_s: float = 15.0
    lease_renew_s: float = 5.0
    #: the image worker Pods run when the pool's template names none
    worker_image: str = "ghcr.io/agent-substrate/substrate:0.1.0"
    worker_port: int = 8081
    #: where the worker's workspace volume is mounted (an emptyDir unless the template brings one)
    worker_root: str = "/var/lib/substrate"
    redis_secret: str = "substrate-redis"
    token_secret: str = "substrate-internal-token"
    #: workers replaced at once when a pool's pod template changes
    max_surge: int = 1
    #: a Pod Unschedulable this long puts the pool's condition ``PodsSchedulable`` to False
    unschedulable_grace_s: float = 10.0
    #: back-off between re-creations of failing Pods of one pool (doubles up to the max)
    failure_backoff_s: float = 1.0
    failure_backoff_max_s: float = 60.0


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
    kubernetes: KubernetesSettings = Field(default_factory=KubernetesSettings)
    #: folder of ActorTemplate / WorkerPool YAML files for the local mode (default: the example pool and
    #: agents shipped inside the package, so ``substrate up`` runs from any folder)
    config_dir: Path = EXAMPLES_DIR
    #: the one folder for runtime data of the embedded default: ``workers/`` (workspaces) and
    #: ``snapshots/`` (the local snapshot store) unless ``worker.root_dir`` / ``snapshot.local_dir`` are set
    data_dir: Path = Path("var")
    #: where templates and pools come from: ``files`` (config_dir) or ``kubernetes`` (the API server)
    catalog_source: Literal["files", "kubernetes"] = "files"
    #: what ``api.main:app`` runs: ``embedded`` (substrate up) or ``router`` (API + proxy only)
    role: Literal["embedded", "router"] = "embedded"
    log_level: str = "INFO"
    log_json: bool = True

    def model_post_init(self, __context: object) -> None:
        short = os.environ.get("SUBSTRATE_REDIS_URL")
        if short and not self.redis.url:
            self.redis.url = short
        if "root_dir" not in self.worker.model_fields_set:
            self.worker.root_dir = self.data_dir / "workers"
        if "local_dir" not in self.snapshot.model_fields_set:
            self.snapshot.local_dir = self.data_dir / "snapshots"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Process-wide settings, read once from the environment."""
    return Settings()
