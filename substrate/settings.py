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
    #: shared secret the router and state manager send to workers (``X-Substrate-Internal-Token``);
    #: generated at start-up when unset. Set the same value on every router of one deployment.
    internal_token: str | None = None
    heartbeat_s: float = 1.0
    lease_s: float = 5.0
    #: a slot counts as active (demand for the autoscaler) while its session is mid-turn or had a turn
    #: within this window; idle sessions beyond it are evictable capacity (lazy suspension)
    active_window_s: float = 2.0
    root_dir: Path = Path("var/workers")


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
    #: the pool shrinks only below the largest size wanted over this window (hysteresis)
    scale_down_delay_s: float = 10.0
    #: window of the activation arrival-rate forecast (creates + wakes per second)
    forecast_window_s: float = 30.0
    #: assumed create-to-READY time of a worker until one was measured
    lead_time_s: float = 0.5
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
