"""Typed specs and records.

* ``ActorTemplate`` and ``WorkerPool`` follow the Kubernetes object shape (``apiVersion``, ``kind``,
  ``metadata``, ``spec``, ``status``) from the seed article 002 so the same YAML works as a CRD and as a
  plain file for the local mode. Unknown fields are kept (``extra="allow"``) because users paste pod
  templates we do not interpret.
* ``SessionRecord``, ``WorkerRecord`` and ``SnapshotRef`` are what the directory (Redis) stores.
"""

from __future__ import annotations

import re
import time
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

API_GROUP = "substrate.agent.dev"
API_VERSION = f"{API_GROUP}/v1"

#: session IDs chosen by clients (DESIGN / issue 2): lower-case, 1..128 chars
SESSION_ID_RE = re.compile(r"^[a-z0-9][a-z0-9\-_.]{0,127}$")
#: Kubernetes DNS-1123 subdomain-ish names for templates and pools
NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9\-.]{0,251}[a-z0-9])?$")

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


def parse_duration_s(value: str | int | float | None) -> float | None:
    """Parse ``"60s"``, ``"5m"``, ``"1h"``, ``"250ms"`` or a bare number of seconds into seconds.

    Raises ``ValueError`` for anything else. ``None`` passes through.
    """
    if value is None:
        return None
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("duration must be >= 0")
        return float(value)
    m = _DURATION_RE.match(value)
    if not m:
        raise ValueError(f"not a duration: {value!r} (use e.g. 30s, 5m, 1h)")
    n, unit = float(m.group(1)), m.group(2) or "s"
    return n * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[unit]


class SessionState(str, Enum):
    """The lifecycle (DESIGN.md). ``FAILED`` is recoverable from the last good snapshot."""

    PENDING = "PENDING"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    SUSPENDING = "SUSPENDING"
    SUSPENDED = "SUSPENDED"
    RESUMING = "RESUMING"
    FAILED = "FAILED"
    DELETED = "DELETED"

    @property
    def transitional(self) -> bool:
        return self in TRANSITIONAL


TRANSITIONAL = frozenset({SessionState.PENDING, SessionState.STARTING, SessionState.SUSPENDING,
                          SessionState.RESUMING})


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    generation: int = 1

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"invalid name {v!r}: use lower-case letters, digits, '-' and '.'")
        return v


class EnvVar(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    value: str | None = None
    valueFrom: dict[str, Any] | None = None


class StateManagement(BaseModel):
    model_config = ConfigDict(extra="allow")
    snapshotInterval: str | float | None = "60s"
    maxIdleTime: str | float | None = "300s"
    snapshotStorage: str | None = None

    @field_validator("snapshotInterval", "maxIdleTime")
    @classmethod
    def _dur(cls, v: Any) -> Any:
        parse_duration_s(v)
        return v

    @property
    def snapshot_interval_s(self) -> float | None:
        v = parse_duration_s(self.snapshotInterval)
        return v or None  # 0 disables periodic snapshots

    @property
    def max_idle_time_s(self) -> float | None:
        v = parse_duration_s(self.maxIdleTime)
        return v or None  # 0 disables idle suspension


class Isolation(BaseModel):
    model_config = ConfigDict(extra="allow")
    runtimeClass: str | None = None
    networkPolicy: str | None = None
    maxCpu: str | None = None
    maxMemory: str | None = None


class ContainerSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    image: str
    env: list[EnvVar] = Field(default_factory=list)


class ActorTemplateSpec(BaseModel):
    """What a session runs. Exactly one of ``entrypoint`` (``module:Class`` of a Python handler),
    ``command`` (an executable speaking JSON lines) or ``container`` (image, Kubernetes backend) is set.
    ``workerPool`` names the pool whose workers host it (default: the only/first pool)."""

    model_config = ConfigDict(extra="allow")
    framework: str | None = None
    entrypoint: str | None = None
    command: list[str] | None = None
    container: ContainerSpec | None = None
    env: list[EnvVar] = Field(default_factory=list)
    workerPool: str | None = None
    stateManagement: StateManagement = Field(default_factory=StateManagement)
    isolation: Isolation = Field(default_factory=Isolation)

    @field_validator("entrypoint")
    @classmethod
    def _entry(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", v):
            raise ValueError(f"entrypoint must look like 'package.module:Class', got {v!r}")
        return v

    def model_post_init(self, __context: Any) -> None:
        if not (self.entrypoint or self.command or self.container):
            raise ValueError("an ActorTemplate needs one of spec.entrypoint, spec.command, spec.container")


class ActorTemplate(BaseModel):
    model_config = ConfigDict(extra="allow")
    apiVersion: str = API_VERSION
    kind: str = "ActorTemplate"
    metadata: ObjectMeta
    spec: ActorTemplateSpec

    @property
    def name(self) -> str:
        return self.metadata.name


class Autoscaling(BaseModel):
    model_config = ConfigDict(extra="allow")
    minReplicas: int = Field(1, ge=0)
    maxReplicas: int = Field(10, ge=1)
    #: percent of slots busy the autoscaler aims for
    targetUtilization: int = Field(70, ge=1, le=100)
    #: HPA metrics (autoscaling/v2 MetricSpec): when set, a HorizontalPodAutoscaler drives /scale instead
    metrics: list[dict[str, Any]] | None = None


class WarmPool(BaseModel):
    model_config = ConfigDict(extra="allow")
    #: free slots kept ready ahead of demand, counted in whole workers
    readyReplicas: int = Field(1, ge=0)


class WorkerPoolSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    replicas: int = Field(2, ge=0)
    #: session slots per worker
    slots: int = Field(8, ge=1, le=4096)
    template: dict[str, Any] = Field(default_factory=dict)
    autoscaling: Autoscaling | None = None
    warmPool: WarmPool | None = None
    snapshotStorage: str | None = None
    resourceClaims: list[dict[str, Any]] = Field(default_factory=list)
    #: GPUs by attributes, compiled to a DRA ResourceClaimTemplate (``substrate.k8s.dra``): count,
    #: minMemory, product, architecture, minComputeCapability, migProfile, deviceClassName, gang
    accelerators: dict[str, Any] | None = None

    @field_validator("accelerators")
    @classmethod
    def _acc(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            from substrate.k8s.dra import validate_accelerators

            validate_accelerators(v)
        return v

    @field_validator("snapshotStorage")
    @classmethod
    def _storage(cls, v: str | None) -> str | None:
        if v is not None:
            from substrate.k8s.snapshot_uri import parse_storage_uri

            parse_storage_uri(v)
        return v

    @field_validator("resourceClaims")
    @classmethod
    def _claims(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for c in v:
            refs = [k for k in ("resourceClaimName", "resourceClaimTemplateName") if c.get(k)]
            if not c.get("name") or len(refs) != 1:
                raise ValueError("each resourceClaims entry needs a name and exactly one of "
                                 "resourceClaimName / resourceClaimTemplateName")
        return v


class Condition(BaseModel):
    type: str
    status: str
    reason: str = ""
    message: str = ""
    lastTransitionTime: float = Field(default_factory=time.time)


class WorkerPoolStatus(BaseModel):
    replicas: int = 0
    readyReplicas: int = 0
    slots: int = 0
    freeSlots: int = 0
    #: free slots on READY workers (what a wake can use now)
    availableSlots: int = 0
    #: label selector of the worker Pods in string form (the /scale subresource reads it)
    selector: str = ""
    observedGeneration: int = 0
    conditions: list[Condition] = Field(default_factory=list)


class WorkerPool(BaseModel):
    model_config = ConfigDict(extra="allow")
    apiVersion: str = API_VERSION
    kind: str = "WorkerPool"
    metadata: ObjectMeta
    spec: WorkerPoolSpec = Field(default_factory=WorkerPoolSpec)
    status: WorkerPoolStatus = Field(default_factory=WorkerPoolStatus)

    @property
    def name(self) -> str:
        return self.metadata.name


class SnapshotRef(BaseModel):
    """Pointer to one committed snapshot: object key, the epoch that wrote it, time, size, checksum."""

    key: str
    epoch: int
    createdAt: float
    sizeBytes: int
    sha256: str


class RestoredFrom(BaseModel):
    """What a recovery restored: the snapshot's time and epoch, and why (``crash``, ``resume``)."""

    snapshotKey: str | None
    snapshotCreatedAt: float | None
    snapshotEpoch: int | None
    reason: str
    at: float = Field(default_factory=time.time)


class SessionRecord(BaseModel):
    """One session as the directory holds it. ``epoch`` is the activation fencing token."""

    id: str
    state: SessionState
    actorTemplate: str
    pool: str
    worker: str | None = None
    slot: int | None = None
    epoch: int = 0
    labels: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    createdAt: float
    updatedAt: float
    lastActiveAt: float
    stateDeadline: float | None = None
    snapshot: SnapshotRef | None = None
    previousSnapshot: SnapshotRef | None = None
    restoredFrom: RestoredFrom | None = None
    reason: str | None = None
    message: str | None = None
    turns: int = 0


class WorkerState(str, Enum):
    STARTING = "STARTING"
    READY = "READY"
    DRAINING = "DRAINING"


class WorkerRecord(BaseModel):
    """A registered worker: where to reach it, its pool and slot count, its lease expiry (epoch s)."""

    id: str
    pool: str
    address: str
    slots: int
    state: WorkerState = WorkerState.READY
    leaseExpiresAt: float
    startedAt: float
    pid: int | None = None
    freeSlots: int = 0
    #: slots whose session is mid-turn or was active within the worker's active window
    activeSlots: int = 0
