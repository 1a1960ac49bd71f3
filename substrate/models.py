"""Typed specs and records.

* ``ActorTemplate`` and ``WorkerPool`` follow the Kubernetes object shape (``apiVersion``, ``kind``,
  ``metadata``, ``spec``, ``status``) from the seed article 002 so the same YAML works as a CRD and as a
  plain file for the local mode. Unknown fields are kept (``extra="allow"``) because users paste pod
  templates we do not interpret.
* ``SessionRecord``, ``WorkerRecord`` and ``SnapshotRef`` are what the directory (Redis) stores.
"""

from __future__ import annotations

import math
import re
import time
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

def _not_a_bool(v: Any) -> Any:
    """Refuse YAML's ``true``/``false`` where a count belongs: pydantic reads ``true`` as 1, so
    ``maxRunning: true`` (meant as "limit running sessions") became a limit of one, without a word
    (fresh-user round 8). Raises ``ValueError``."""
    if isinstance(v, bool):
        raise ValueError(f"a whole number is required here, not {str(v).lower()}")
    return v


#: a whole number written by a user (spec counts, quota limits): a bool is refused, not read as 0 or 1
Count = Annotated[int, BeforeValidator(_not_a_bool)]
#: the largest replica count Kubernetes takes (the CRDs' ``format: int32``, as a Deployment's)
INT32_MAX = 2**31 - 1

API_GROUP = "substrate.agent.dev"
API_VERSION = f"{API_GROUP}/v1"

#: session IDs chosen by clients (DESIGN / issue 2): lower-case, 1..128 chars
#: anchored with \A..\Z (never ``$``, which also matches before a final newline): ``match`` and
#: ``fullmatch`` both check the whole string
SESSION_ID_RE = re.compile(r"\A[a-z0-9][a-z0-9\-_.]{0,127}\Z")
#: what a refusal of a malformed session ID tells the client to use
SESSION_ID_HINT = "use [a-z0-9][a-z0-9._-]{0,127}"
#: an Idempotency-Key (an sf-string, as in the IETF httpapi draft "The Idempotency-Key HTTP Header Field"):
#: printable ASCII, at most ``MAX_IDEMPOTENCY_KEY_CHARS``. It is forwarded to the worker as a header and kept
#: as a key of the session's answers: a control character or a non-ASCII byte would be mangled or refused
#: there. The router (``api.proxy``) and the SDK (``substrate.client``) check it by this one rule
MAX_IDEMPOTENCY_KEY_CHARS = 200
IDEMPOTENCY_KEY_RE = re.compile(r"[\x20-\x7e]{1,%d}" % MAX_IDEMPOTENCY_KEY_CHARS)
#: Kubernetes DNS-1123 subdomain-ish names for templates and pools
NAME_RE = re.compile(r"\A[a-z0-9]([a-z0-9\-.]{0,251}[a-z0-9])?\Z")

_DURATION_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h)?\s*")


#: the longest duration a spec may give (s): a year; longer ones are typos or "never" written as a number
MAX_DURATION_S = 365 * 86400.0


def clip_value(value: Any, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters with a note of the length (for error messages)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def parse_duration_s(value: str | int | float | None) -> float | None:
    """Parse ``"60s"``, ``"5m"``, ``"1h"``, ``"250ms"`` or a bare number of seconds into seconds.

    Raises ``ValueError`` for anything else. ``None`` passes through.
    """
    if value is None:
        return None
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            # YAML's .nan and .inf parse as floats: a maxIdleTime of .nan suspended the session after every
            # turn and read back as null (never), an snapshotInterval of .nan snapshotted every tick
            # (fresh-user round 18)
            raise ValueError(f"duration must be a finite number of seconds, not {value}")
        if value < 0:
            raise ValueError("duration must be >= 0")
        if value > MAX_DURATION_S:
            raise ValueError(f"duration must be at most {MAX_DURATION_S:.0f} s (a year), got {clip_value(value)}")
        return float(value)
    m = _DURATION_RE.fullmatch(value)
    if not m:
        raise ValueError(f"not a duration: {value!r} (use e.g. 30s, 5m, 1h)")
    n, unit = float(m.group(1)), m.group(2) or "s"
    out = n * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[unit]
    if out > MAX_DURATION_S:  # 400 digits parsed to inf and read back as the 400 digits (fresh-user round 19)
        raise ValueError(f"duration must be at most {MAX_DURATION_S:.0f} s (a year), got {clip_value(value)}")
    return out


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
#: the states of an activation that has answered no turn yet: a turn is sent only once the record says
#: RUNNING, so cutting one of these off (its worker died, its deadline passed) loses nothing since the
#: snapshot it started from, and the recovery sets no loss marker of its own (a loss still unreported
#: from before, the record's ``reason``, stays)
UNANSWERED = frozenset({SessionState.STARTING, SessionState.RESUMING})

#: the states a session listing can show (``?state=``, ``sessions list --state``): a deleted session is gone
LISTABLE_STATES = tuple(s for s in SessionState if s != SessionState.DELETED)


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
        if not NAME_RE.fullmatch(v):
            raise ValueError(f"invalid name {v!r}: use lower-case letters, digits, '-' and '.'")
        return v


#: an environment variable name a template may set (POSIX's portable form; a shell passes no other on)
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,254}")


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


def parse_quantity_value(value: str | int | float | None, what: str) -> float | None:
    """A Kubernetes quantity (``"512Mi"``, ``"500m"``, ``"2"``) as a float, parsed by the kubernetes
    client's ``parse_quantity``. ``None`` passes through. Raises ``ValueError`` naming ``what``."""
    if value is None:
        return None
    from kubernetes.utils import parse_quantity  # the library's parser (imported lazily: it is heavy)

    try:
        q = parse_quantity(value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{what}: not a quantity: {value!r} (use e.g. 512Mi, 2Gi, 500m, 2)") from e
    if not q.is_finite() or not math.isfinite(float(q)):  # YAML's .inf, "1e309": beyond a float
        raise ValueError(f"{what} must be a finite quantity, got {clip_value(value)}")
    if q <= 0:
        raise ValueError(f"{what} must be > 0, got {value!r}")
    return float(q)


#: the smallest value of each isolation quantity, and how it is said: a memory limit below 1 MiB cannot
#: hold any agent host (the kernel refuses such a cgroup limit outright); a CPU quota below 1 ms per
#: 100 ms period (10m) is raised to that by the kernel's minimum; a disk limit is whole bytes
#: the largest byte limit a template may ask for (the kernel's limits are signed 64-bit counts)
_MAX_BYTES = (1 << 63) - 1
#: the largest CPU limit a template may ask for (more cores than any machine has; the kernel's CFS quota
#: holds at most ~17,592 s per period, about 175,000 cores of a 100 ms period)
_MAX_CPU_CORES = 4096
_LEAST = {"maxMemory": (1 << 20, "1Mi (an agent host needs tens of MiB)"),
          "maxCpu": (0.01, "10m (the kernel's smallest CPU quota: 1 ms per 100 ms)"),
          "maxDiskBytes": (1, "1 (whole bytes)")}


class Isolation(BaseModel):
    """Per-session isolation and limits (``workers/sandbox.py`` enforces them; README "Security model").

    ``sandbox: false`` is the explicit opt-out from the per-session bubblewrap sandbox (the session's
    status shows ``sandboxed: false``). ``network``: ``none`` (default: no network namespace interface
    but the sandbox's own), ``loopback`` (its own loopback only) or ``egress`` (the host's network).
    ``maxCpu``/``maxMemory``/``maxDiskBytes`` are Kubernetes quantities; ``turnTimeout`` a duration.
    Malformed values are refused when the template is loaded."""

    model_config = ConfigDict(extra="allow")
    runtimeClass: str | None = None
    networkPolicy: str | None = None
    sandbox: bool = True
    network: Literal["none", "loopback", "egress"] = "none"
    #: quantities; a number is taken as one and kept as its string (the CRD: int-or-string)
    maxCpu: str | int | None = None
    maxMemory: str | int | None = "1Gi"
    maxDiskBytes: str | int | None = "1Gi"
    maxProcesses: Count | None = Field(256, ge=1, le=65536)
    turnTimeout: str | float | None = "300s"

    @field_validator("maxCpu", "maxMemory", "maxDiskBytes", mode="before")
    @classmethod
    def _quantity(cls, v: Any, info: Any) -> Any:
        # a plain number is a quantity too (``maxDiskBytes: 1073741824``, ``maxCpu: 2``), as Kubernetes
        # takes it: it was refused with pydantic's "Input should be a valid string" (fresh-user run)
        if isinstance(v, bool):  # YAML's yes/no/true: never a quantity
            raise ValueError(f"isolation.{info.field_name} must be a quantity, not {v!r}")
        if isinstance(v, (int, float)):
            v = repr(v) if isinstance(v, float) else str(v)
        q = parse_quantity_value(v, f"isolation.{info.field_name}")
        # the least each limit can mean: below it a limit was no limit at all (a fresh-user run:
        # maxMemory "0.5" truncated to 0 bytes, which the sandbox reads as "unlimited") or not the one asked
        least, why = _LEAST[info.field_name]
        if q is not None and q < least:
            raise ValueError(f"isolation.{info.field_name} must be at least {why}, got {v!r}")
        # bytes are whole: "1.5" was loaded and used as 1 (fresh-user round 16)
        if q is not None and info.field_name == "maxDiskBytes" and q != int(q):
            raise ValueError(f"isolation.{info.field_name} must be a whole number of bytes, got {v!r}")
        # beyond what the kernel's limits can hold (a 64-bit count of bytes): no limit a machine has
        if q is not None and info.field_name in ("maxMemory", "maxDiskBytes") and q > _MAX_BYTES:
            raise ValueError(f"isolation.{info.field_name} must be under 8Ei (2^63 bytes), got {v!r}")
        # the CFS quota (cores x 100 ms period, in µs) must fit the kernel's: "1e18" loaded and every create
        # then failed "Numerical result out of range", "1e309" overflowed to infinity (fresh-user round 19)
        if q is not None and info.field_name == "maxCpu" and q > _MAX_CPU_CORES:
            raise ValueError(f"isolation.maxCpu must be at most {_MAX_CPU_CORES} cores, got {v!r}")
        return v

    @field_validator("turnTimeout")
    @classmethod
    def _turn_timeout(cls, v: Any) -> Any:
        if parse_duration_s(v) == 0:
            raise ValueError("turnTimeout must be > 0 (omit it for the default)")
        return v

    @property
    def cpu_cores(self) -> float | None:
        return parse_quantity_value(self.maxCpu, "isolation.maxCpu")

    @property
    def memory_bytes(self) -> int | None:
        v = parse_quantity_value(self.maxMemory, "isolation.maxMemory")
        return None if v is None else int(v)

    @property
    def disk_bytes(self) -> int | None:
        v = parse_quantity_value(self.maxDiskBytes, "isolation.maxDiskBytes")
        return None if v is None else int(v)

    @property
    def turn_timeout_s(self) -> float:
        return parse_duration_s(self.turnTimeout) or 300.0


class ContainerSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    image: str
    env: list[EnvVar] = Field(default_factory=list)


class QuotaLimits(BaseModel):
    """Limits of one tenant (or of one tenant's sessions of one ActorTemplate); ``None`` = unlimited.

    ``maxRunning`` counts live activations (STARTING/RUNNING/RESUMING/SUSPENDING): suspended sessions
    hold none; ``maxTotal`` counts every session that exists; ``maxGpus`` counts GPUs held by live
    activations (``spec.resources.gpus`` of their template); ``maxCreatesPerMinute`` is a sliding window.
    """

    model_config = ConfigDict(extra="forbid")
    maxRunning: Count | None = Field(None, ge=0)
    maxTotal: Count | None = Field(None, ge=0)
    maxGpus: Count | None = Field(None, ge=0)
    maxCreatesPerMinute: Count | None = Field(None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _any_case(cls, data: Any) -> Any:
        """Field names in any case: the nested environment form (``SUBSTRATE_QUOTA__TENANTS__A__MAXTOTAL``)
        reaches here lower-cased (``maxtotal``), which ``extra="forbid"`` refused."""
        if not isinstance(data, dict):
            return data
        names = {n.lower(): n for n in cls.model_fields}
        return {names.get(k.lower(), k) if isinstance(k, str) else k: v for k, v in data.items()}


class TemplateResources(BaseModel):
    """What one live session of a template holds (for quotas and the audit trail)."""

    model_config = ConfigDict(extra="allow")
    #: whole GPUs (devices of the pool's ResourceClaims) one live session holds
    gpus: Count = Field(0, ge=0)


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
    resources: TemplateResources = Field(default_factory=TemplateResources)
    #: limits per tenant for this task class (each tenant's sessions of this template); see QuotaLimits
    quota: QuotaLimits | None = None

    @field_validator("env")
    @classmethod
    def _env(cls, v: list[EnvVar]) -> list[EnvVar]:
        """Names a process environment and a shell can carry, each once, and values without NUL: such a
        template loaded, then every create of it failed 500 ``agent_start_failed`` ("illegal environment
        variable name", "Invalid argument") naming neither the template nor the variable; ``bad-name``
        was dropped by the shell agent's shell, and a name given twice kept its last value, both
        without a word (fresh-user round 9)."""
        first: dict[str, int] = {}
        for i, e in enumerate(v):
            if not _ENV_NAME_RE.fullmatch(e.name):
                raise ValueError(f"env[{i}].name {e.name[:80]!r} is not an environment variable name: use letters, "
                                 "digits and '_', not starting with a digit")
            if e.value is not None and "\x00" in e.value:
                raise ValueError(f"env[{i}] ({e.name}): the value holds a NUL character, which no environment "
                                 "can carry")
            if e.name in first:
                raise ValueError(f"env[{i}].name {e.name!r} is given twice (also env[{first[e.name]}]): give "
                                 "each variable once")
            first[e.name] = i
        return v

    @field_validator("entrypoint")
    @classmethod
    def _entry(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError(f"entrypoint must look like 'package.module:Class', got {v!r}")
        return v

    def model_post_init(self, __context: Any) -> None:
        if not (self.entrypoint or self.command or self.container):
            raise ValueError("an ActorTemplate needs one of spec.entrypoint, spec.command, spec.container")
        if self.entrypoint and self.command:  # which one runs would be a guess (the command won, silently)
            raise ValueError("an ActorTemplate sets spec.entrypoint or spec.command, not both")


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
    minReplicas: Count = Field(1, ge=0, le=INT32_MAX)
    maxReplicas: Count = Field(10, ge=1, le=INT32_MAX)
    #: percent of slots busy the autoscaler aims for
    targetUtilization: Count = Field(70, ge=1, le=100)
    #: HPA metrics (autoscaling/v2 MetricSpec): when set, a HorizontalPodAutoscaler drives /scale instead
    metrics: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _bounds_in_order(self) -> "Autoscaling":
        # maxReplicas is the safety bound: a floor above it started minReplicas workers anyway
        if self.minReplicas > self.maxReplicas:
            raise ValueError(f"autoscaling.minReplicas ({self.minReplicas}) is above maxReplicas ({self.maxReplicas})")
        return self


class WarmPool(BaseModel):
    model_config = ConfigDict(extra="allow")
    #: free slots kept ready ahead of demand, counted in whole workers
    readyReplicas: Count = Field(1, ge=0, le=INT32_MAX)


class WorkerPoolSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    replicas: Count = Field(2, ge=0, le=INT32_MAX)
    #: session slots per worker
    slots: Count = Field(8, ge=1, le=4096)
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


def rfc3339_now() -> str:
    """Now in UTC as RFC 3339 to the second (``2026-12-07T18:30:00Z``), the form of Kubernetes' times."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Condition(BaseModel):
    """A status condition as Kubernetes API conventions define it: ``type``, ``status`` (``True``,
    ``False``, ``Unknown``), ``reason`` (one CamelCase word, stable for programs), ``message`` (for
    people) and ``lastTransitionTime`` (RFC 3339: when ``status`` last changed, not when last computed)."""

    type: str
    status: str
    reason: str = ""
    message: str = ""
    lastTransitionTime: str = Field(default_factory=rfc3339_now)

    def since(self, previous: list["Condition"]) -> "Condition":
        """This condition with the ``lastTransitionTime`` of the same type in ``previous`` when its
        status is unchanged (it was "now" at every round: fresh-user tester 47)."""
        for c in previous:
            if c.type == self.type and c.status == self.status:
                return self.model_copy(update={"lastTransitionTime": c.lastTransitionTime})
        return self


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
    #: regular files and symlinks in the workspace it holds (its manifest's ``files``): a restore's time
    #: grows with them (``api.restore_s_per_file``); 0 in a snapshot committed before this field
    files: int = Field(0, ge=0)


class RestoredFrom(BaseModel):
    """What a recovery restored: the snapshot's time and epoch, and why (``crash``, ``resume``)."""

    snapshotKey: str | None
    snapshotCreatedAt: float | None
    snapshotEpoch: int | None
    reason: str
    at: float = Field(default_factory=time.time)
    #: with a lossy ``reason``: the time (Unix s) the restored state dates from, i.e. turns acknowledged
    #: after it may be gone; older than ``snapshotCreatedAt`` when that snapshot was taken by an activation
    #: that came back from an older one and ran no turn before it (a drain); 0: no state came back
    lostAfter: float | None = None


#: the values of ``SessionRecord.suspendReason``
SUSPEND_REASONS = ("explicit", "idle", "pressure", "drain")


class SessionRecord(BaseModel):
    """One session as the directory holds it. ``epoch`` is the activation fencing token."""

    id: str
    state: SessionState
    actorTemplate: str
    pool: str
    #: the tenant that owns the session (``default`` when the API runs without keys)
    tenant: str = "default"
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
    #: why a SUSPENDED session was suspended: ``explicit`` (the suspend API), ``idle`` (its idle
    #: timeout), ``pressure`` (its slot was needed), ``drain`` (its worker went away gracefully); set by
    #: the snapshot commit that suspends it, cleared by the wake. A recovery's reason is in ``reason``.
    suspendReason: str | None = None
    #: with a lossy ``reason``: the time (Unix s) the state to be restored dates from, when the current
    #: ``snapshot`` was committed by an activation that restored older state and answered no turn (so no
    #: client was told of the loss yet, and the loss and its base stay for the next wake); 0: no state
    #: came back then (no snapshot existed). Cleared by a commit of an activation that answered a turn.
    lostAfter: float | None = None
    turns: int = 0
    #: answers (``[key, [status, body, digest, restored, restoredAt]]``) of turns that failed when an
    #: agent died, carried by the record to the session's next activation (the activation that ran them
    #: ended with them), so a retry is answered, never run again; cleared by the next committed snapshot,
    #: which holds them. Internal: not in the public session view.
    carriedAnswers: list[list[Any]] = Field(default_factory=list)


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
    #: epoch s (the worker's clock) when ``activeSlots`` was counted: an activation that became RUNNING
    #: later is not in it yet (the activator counts it as in flight until then); None: not reported
    activeSlotsAt: float | None = None
    #: epoch s of the latest slot claimed on this worker, by any router (``Directory.claim_slot``); None: never
    placedAt: float | None = None
    #: free slots whose pre-started agent host has booted, as of the worker's last heartbeat (an activation
    #: there starts at once; elsewhere it waits for a host to boot); None: not reported
    warmSlots: int | None = None
    #: slots taken (the slot table's size) when ``warmSlots`` was reported: ``Directory.list_workers``
    #: subtracts the claims made since
    warmSlotsAtUsed: int | None = None
    #: GPUs the worker sees and their total memory in bytes, from ``nvidia-smi`` (None: not reported)
    gpus: int | None = None
    gpuMemoryBytes: int | None = None
