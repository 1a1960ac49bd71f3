"""Settings for every component, in one pydantic-settings tree.

Read from environment variables prefixed ``SUBSTRATE_`` with ``__`` between nesting levels
(``SUBSTRATE_API__PORT=8080``, ``SUBSTRATE_SNAPSHOT__STORE=s3``). ``SUBSTRATE_REDIS_URL`` is accepted
as a short alias for ``SUBSTRATE_REDIS__URL`` because it is the one setting almost every user sets.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import types
import typing
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from substrate.models import QuotaLimits
from substrate.netports import parse_port_range
from substrate.text import unprintable


#: the example WorkerPool and ActorTemplates shipped inside the package
EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"

#: tenant names: DNS-label-like, so they fit in keys, labels and log fields unchanged
TENANT_RE = re.compile(r"^[a-z0-9]([a-z0-9\-]{0,61}[a-z0-9])?$")

#: the longest API key name (a label shown by ``keys list``, and a file key's ID)
KEY_NAME_MAX_CHARS = 128


def key_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name an API key, or None (``""``: no name). A name is a label in ``keys list``
    and a file key's ID (``keys revoke NAME``): at most :data:`KEY_NAME_MAX_CHARS` characters, none that
    ``substrate.text.unprintable`` names (a tab or newline broke the listing's columns, U+202E reversed the
    rest of its row), no space at either end, and not starting with ``sk_`` (it would read as a key).
    Fresh-user runs created keys named with tabs, 300 characters, ``sk_...`` and U+202E without a word."""
    if not name:
        return None
    if len(name) > KEY_NAME_MAX_CHARS:
        return f"a key name is at most {KEY_NAME_MAX_CHARS} characters, not {len(name)}"
    if (bad := unprintable(name)) is not None:
        return (f"a key name has no control character, line or paragraph separator, bidi control, invisible "
                f"character (U+200B ...) or byte that "
                f"is not UTF-8 ({bad}): {name[:60]!r}")
    if name != name.strip():
        return f"a key name does not begin or end with a space: {name[:60]!r}"
    if name.startswith("sk_"):
        return f"a key name does not start with 'sk_' (it would read as a key): {name[:60]!r}"
    return None


_HEX64 = re.compile(r"^[0-9a-f]{64}$")

#: URL schemes the runtime connects to (redis-py's three, and ``redis+cluster://`` of substrate.directory)
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster")


def redis_url_problem(url: str) -> str | None:
    """None if ``url`` has the shape of a Redis URL the runtime can use, else what is wrong with it (checked
    at settings load: a bad URL otherwise failed only after the API had started)."""
    from urllib.parse import urlsplit

    usage = "use redis://host:port/db, rediss://..., unix:///path/to/redis.sock or redis+cluster://host:port"
    try:
        u = urlsplit(url)
        u.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError as e:
        return f"not a Redis URL ({e}): {usage}"
    if u.scheme not in REDIS_SCHEMES or "://" not in url:
        return f"not a Redis URL (scheme {u.scheme + '://' if u.scheme else 'missing'}): {usage}"
    if u.scheme == "unix" and not u.path:
        return f"not a Redis URL (no socket path): {usage}"
    if u.scheme != "unix" and not u.hostname:
        return f"not a Redis URL (no host): {usage}"
    # redis-py reads a database that is not a number as database 0, silently (a fresh-user run wrote
    # into database 0 of a shared Redis through ``/abc``)
    from urllib.parse import parse_qs

    dbs = parse_qs(u.query).get("db", [])
    if u.scheme in ("redis", "rediss") and u.path.strip("/"):
        dbs.append(u.path.strip("/"))
    for db in dbs:
        if not (db.isascii() and db.isdigit()):
            return f"not a Redis URL (database {db[:40]!r} is not a number): {usage}"
    return None


class _Section(BaseModel):
    """A settings group. Numbers must be finite: ``inf`` passed every ``gt=0`` bound, and the local
    backend hands settings to workers as JSON, which writes ``inf`` as ``null``: every worker then
    died at start-up, restarted once a second for ever (fresh-user run)."""

    model_config = ConfigDict(allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _plausible(cls, v: object) -> object:
        """Numbers no setting can mean: a float above ``MAX_FLOAT_SETTING`` (seconds: 31 years) or an int
        above ``MAX_INT_SETTING`` (bytes: a petabyte). ``1e300`` passed every bound, then Redis refused the
        EXPIRE made from it on every delete (fresh-user run 2)."""
        if isinstance(v, bool):
            return v
        if isinstance(v, float) and abs(v) > MAX_FLOAT_SETTING:
            raise ValueError(f"{v:g} is implausibly large (at most {MAX_FLOAT_SETTING:g})")
        if isinstance(v, int) and abs(v) > MAX_INT_SETTING:
            raise ValueError(f"{v} is implausibly large (at most {MAX_INT_SETTING})")
        return v


#: the largest float and int any setting accepts (see ``_Section._plausible``)
MAX_FLOAT_SETTING = 1e9
MAX_INT_SETTING = 10**15


#: an ``ApiSettings.allowed_hosts`` entry that is not an IP address: a DNS name (a trailing dot allowed)
_ALLOWED_HOST_RE = re.compile(r"(?:[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\.)*"
                              r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\.?")

#: ``RedisSettings.key_prefix``
_KEY_PREFIX_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._:-]{0,62}[A-Za-z0-9._-])?")


class RedisSettings(_Section):
    """Where the directory lives. ``url=None`` means: start an embedded Redis server (persistent: AOF
    in ``data_dir``). A Redis Cluster: ``redis+cluster://host:port/0``."""

    url: str | None = None

    @field_validator("url")
    @classmethod
    def _a_redis_url(cls, v: str | None) -> str | None:
        if v and (why := redis_url_problem(v)):
            raise ValueError(why)
        return v or None

    #: data folder of the embedded Redis (append-only file), so a restart keeps every session; unset:
    #: ``<Settings.data_dir>/redis``
    data_dir: Path = Path("var/redis")
    #: every key is ``<key_prefix>:{<session>}:...`` (substrate/keys.py): one deployment or test run each
    key_prefix: str = "substrate"
    socket_timeout_s: float = Field(2.0, gt=0)

    @field_validator("key_prefix")
    @classmethod
    def _a_key_prefix(cls, v: str) -> str:
        # a trailing ':' doubled the separator (``x::{s1}:session``; a fresh-user run), and a '{' or '}'
        # would make the prefix a Redis Cluster hash tag, putting every key in one slot
        if not _KEY_PREFIX_RE.fullmatch(v):
            raise ValueError(f"{v[:80]!r} is not a key prefix: use 1-64 letters, digits, '.', '_', '-' or ':', "
                             "starting with a letter or digit and not ending with ':' (keys are "
                             "'<prefix>:{<session>}:...')")
        return v


#: the shortest ``api.auth_token`` accepted (an admin credential; as the internal token's bound)
MIN_AUTH_TOKEN_CHARS = 16


class ApiSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    #: host names (without port) besides localhost, 127.0.0.0/8 and ::1 that an open-mode API (no
    #: credentials) answers to on a loopback address; any other ``Host`` is refused (403
    #: ``host_not_allowed``: the DNS-rebinding defence, api/guard.py). JSON list in the environment
    allowed_hosts: list[str] = Field(default_factory=list)

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, v: list[str]) -> list[str]:
        # an entry no Host can match ("bad host", "example.com:8080") was accepted silently (a fresh-user
        # run): a name, or an IP address (an IPv6 one with or without brackets), without a port
        import ipaddress

        out = []
        for name in v:
            bare = name[1:-1] if name.startswith("[") and name.endswith("]") else name
            try:
                out.append(str(ipaddress.ip_address(bare)))  # as the Host check compares it: no brackets
                continue
            except ValueError:
                pass
            if not _ALLOWED_HOST_RE.fullmatch(name):
                raise ValueError(f"{name[:80]!r} is not a host name: give a name (letters, digits, '-', '.') or "
                                 "an IP address, without a port")
            out.append(name)
        return out

    max_body_bytes: int = Field(1 * 1024 * 1024, gt=0)
    #: how long a request's body may take to arrive, counted from its headers (s): a client that trickles
    #: or never finishes its body gets 408 ``request_timeout`` and its connection is closed, instead of
    #: holding a connection and a handler for ever. 30 s carries ``max_body_bytes`` at ~35 KB/s.
    body_read_timeout_s: float = Field(30.0, gt=0)
    #: how long a request's head (request line and headers) may take to arrive, counted from its first
    #: byte or, on a new connection, from the connect (s): a client that connects and sends nothing, or
    #: trickles its headers, gets 408 ``request_timeout`` and its connection is closed (uvicorn has no
    #: such limit: one such client per file descriptor could hold the router's connections for ever)
    header_read_timeout_s: float = Field(10.0, gt=0, le=3600)
    #: how long an idle keep-alive connection stays open (s). Longer than clients keep theirs (aiohttp
    #: 15 s, httpx 5 s): with uvicorn's default of 5 s a client reusing a connection the server was
    #: closing at that instant got ``ServerDisconnectedError`` on a POST it cannot safely retry (the
    #: 11-26 replay at 400x, and a fresh-user burst). nginx's default is 75 s as well
    keep_alive_timeout_s: float = Field(75.0, gt=0, le=3600)
    #: how long a request for a SUSPENDED session may wait for its resume (once placed), plus
    #: ``restore_s_per_file`` for each file of the snapshot it restores
    park_timeout_s: float = Field(5.0, ge=0)
    #: the restore's extra time per file of the snapshot (s): a workspace of 60,000 small files took
    #: ~7 s to wake, and its first call got 503 ``resume_timeout`` while the wake went on (file
    #: creation, not bytes, bounds such a restore: about 30-120 us a file here)
    restore_s_per_file: float = Field(0.0002, ge=0, le=1)
    #: cap on requests parked at once in one router process
    max_parked: int = Field(1000, ge=0)
    #: how long a request waits for a free slot before 503 (0 = answer at once), counted from the
    #: slot queue's last progress (a waiter served or room made: ``substrate.slotqueue``)
    slot_wait_s: float = Field(2.0, ge=0)
    #: how long a placement waits for a worker that is being started for its pool (instead of
    #: answering ``no_capacity``); a cold start on a busy machine can take several seconds
    start_wait_s: float = Field(30.0, ge=0)
    #: admission control of activations (creates + wakes) per pool in one router process
    #: (``substrate.admission``): the adaptive bound starts at ``activation_limit_initial`` permits and
    #: stays within ``[activation_limit_min, activation_limit_max]`` (max 0: no bound); it falls when
    #: activations take more than ``activation_latency_tolerance`` times their usual time. Activations
    #: beyond it wait (FIFO, holding no slot, up to ``start_wait_s``) and are not demand for new workers
    activation_limit_initial: int = Field(32, ge=1, le=100_000)
    activation_limit_min: int = Field(4, ge=1, le=100_000)
    activation_limit_max: int = Field(1000, ge=0, le=100_000)
    #: 2: it costs wake latency in ordinary bursts on 2 cores (the limit dips to 4-16 permits), but 4
    #: let the limit climb from 11 to 162 permits inside an overload and the pool run to 19 workers
    #: (docs/bench/2026-12-02-limiter-ab.md): the bound is what the limiter is for
    activation_latency_tolerance: float = Field(2.0, ge=1.0, le=100.0)
    #: under slot pressure, only sessions idle at least this long are suspended to make room
    pressure_min_idle_s: float = Field(1.0, ge=0)
    #: Retry-After sent with 503 answers
    retry_after_s: int = Field(1, ge=0)
    #: how often the router refreshes its view of registered workers
    worker_refresh_s: float = Field(0.5, gt=0)
    #: how many distinct workers may drop one turn after it was sent (reset, crash, lease lost) before the
    #: answer is 502 worker_unavailable (a turn may be what kills its worker); refused connects don't count
    max_lost_worker_retries: int = Field(3, ge=0)
    #: proxied call timeout (a turn may run long)
    invoke_timeout_s: float = Field(300.0, gt=0)
    #: an explicit suspend (``POST .../suspend``) of a session in the middle of a turn waits at most this
    #: long for the turn to end, then answers 409 ``conflict`` (retry): a turn may run for minutes
    suspend_wait_s: float = Field(10.0, ge=0)
    #: optional bearer token; when set every /v1 call must carry it (an admin of tenant ``default``)
    auth_token: str | None = None

    @model_validator(mode="after")
    def _activation_limits_ordered(self) -> "ApiSettings":
        lo, start, hi = self.activation_limit_min, self.activation_limit_initial, self.activation_limit_max
        if start < lo or (hi and hi < start):
            raise ValueError(f"activation limits must satisfy min <= initial <= max (max 0: no bound): got "
                             f"SUBSTRATE_API__ACTIVATION_LIMIT_MIN={lo}, _INITIAL={start}, _MAX={hi}")
        return self

    @field_validator("auth_token")
    @classmethod
    def _not_an_api_key(cls, v: str | None) -> str | None:
        # a tenant's API key here would make that key an admin token (the CLI once read this variable)
        if v is not None and v.startswith("sk_"):
            raise ValueError("SUBSTRATE_API__AUTH_TOKEN holds an API key (sk_...): that would make a tenant's "
                             "key an admin token. The client commands read SUBSTRATE_TOKEN; unset this one "
                             "or give it a secret of its own")
        if v and len(v) < MIN_AUTH_TOKEN_CHARS:
            # it is an admin credential (any tenant's sessions): a fresh-user run started with the token
            # ``a`` and no word, while API keys shorter than 19 characters are refused
            raise ValueError(f"SUBSTRATE_API__AUTH_TOKEN is shorter than {MIN_AUTH_TOKEN_CHARS} characters: it is "
                             "an admin credential, and anyone could guess it; set a secret of its own, e.g. "
                             "the output of `openssl rand -hex 24`")
        return v


class WorkerSettings(_Section):
    host: str = "127.0.0.1"
    #: the ports local workers listen on, ``LO-HI`` (e.g. ``29610-29699``; under ``substrate up`` the
    #: embedded Redis's too): each takes a free one of the range. Unset: ports the kernel picks. A
    #: worker that finds none free exits, and the pool controller tries again. Ignored where a worker is
    #: given its port (on Kubernetes: ``kubernetes.worker_port``)
    port_range: str | None = None
    #: optional secret mixed (HMAC-SHA256) into the activation-token signing keys kept in Redis, so that
    #: read access to Redis alone cannot mint tokens workers accept (see ``substrate.tokens``). Set the
    #: same value on every router, controller and worker (on Kubernetes: the Secret
    #: ``substrate-internal-token``); unset in the embedded default (Redis is private to it there).
    internal_token: str | None = None

    @field_validator("port_range")
    @classmethod
    def _a_port_range(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None  # empty: unset, as for the folder variables
        lo, hi = parse_port_range(v)
        return f"{lo}-{hi}"

    @property
    def ports(self) -> tuple[int, int] | None:
        """``port_range`` as ``(LO, HI)``, inclusive; None when unset."""
        return parse_port_range(self.port_range) if self.port_range else None

    @field_validator("internal_token")
    @classmethod
    def _not_a_placeholder(cls, v: str | None) -> str | None:
        # the shipped overlays' placeholder (deploy/overlays/*/token.env) is public: a known HMAC secret
        if v is not None and ("change-me" in v.lower() or len(v) < 16):
            raise ValueError("the internal token is a placeholder or shorter than 16 characters: set it to a "
                             "secret of its own, e.g. the output of `openssl rand -hex 24`")
        return v

    @field_validator("lease_s")
    @classmethod
    def _lease_outlives_a_late_heartbeat(cls, v: float, info: Any) -> float:
        beat = info.data.get("heartbeat_s")  # validated before (declared first); absent if it was invalid
        if beat is not None and v < 2 * beat:
            raise ValueError(f"({v:g}) must be at least twice SUBSTRATE_WORKER__HEARTBEAT_S ({beat:g}): a worker "
                             "renews its lease each heartbeat, and one late renewal must not let it run out")
        return v
    heartbeat_s: float = Field(1.0, gt=0)
    #: at least twice ``heartbeat_s`` (checked): a lease that one late renewal lets run out has every
    #: worker declared dead over and over (a fresh-user run: lease 0.5 s, heartbeat 5 s)
    lease_s: float = Field(5.0, gt=0, validate_default=True)
    #: a worker stops serving at its own lease expiry (self-fencing); others may declare it dead and
    #: place its sessions elsewhere only this long after that (room for clock skew and a slow tick)
    lease_grace_s: float = Field(1.0, ge=0)
    #: how often a worker compares its activations with the directory and frees what it does not own
    reconcile_s: float = Field(2.0, gt=0)
    #: on SIGTERM (or ``substrate up`` stopping) a worker suspends every session within this bound
    shutdown_grace_s: float = Field(20.0, ge=0)
    #: answers of recent turns kept per activation (and in its snapshot), by idempotency key
    idempotency_keys: int = Field(64, ge=1)
    #: bytes of those answers kept per activation (and in its snapshot), in the worker's memory outside any
    #: sandbox: an answer over it, or the oldest once the sum is over it, is replaced by a small marker
    #: that answers a retry 410 ``answer_not_kept`` (the turn ran; it is never run again)
    answer_keep_bytes: int = Field(4 * 1024 * 1024, ge=0)
    #: largest answer (JSON bytes) of one turn, and of one streamed chunk; larger: 422 ``output_too_large``
    max_answer_bytes: int = Field(16 * 1024 * 1024, gt=0)
    #: a slot counts as active (demand for the autoscaler) while its session is mid-turn or had a turn
    #: within this window; idle sessions beyond it are evictable capacity (lazy suspension)
    active_window_s: float = Field(2.0, ge=0)
    #: a session that has not run a turn since its activation (a create, or a wake with no turn yet) counts
    #: as active for this long from the activation: it was made to be used, and a burst of creates whose
    #: turns follow must not read as idle capacity to suspend while the pool could grow for it
    first_turn_window_s: float = Field(30.0, ge=0)
    root_dir: Path = Path("var/workers")
    #: per-slot sandbox uids are claimed in [sandbox_uid_base, sandbox_uid_base + sandbox_uid_span)
    #: with flock files in sandbox_uid_lock_dir (when the worker runs as root); see workers/sandbox.py
    sandbox_uid_base: int = Field(20000, ge=1)
    sandbox_uid_span: int = Field(10000, ge=1)
    sandbox_uid_lock_dir: Path = Path("/run/substrate/sandbox-uids")
    #: keep a sandboxed agent host started for up to this many free slots (0: none), so a create does
    #: not pay the spawn (each idle host is a Python process of ~10-15 MiB)
    prestart_hosts: int = Field(16, ge=0)
    #: sandboxes a worker keeps beyond its slots (with pre-started hosts only): a slot taken right after
    #: its release (a pressure suspend makes room for a waiting wake or create) would otherwise wait for
    #: its next host's boot (~70 ms of CPU; the wake's ``agent`` phase, p50 76 ms in a day's replay),
    #: while a spare sandbox's host has booted already. Each holds an idle host (~10-15 MiB) and, as
    #: root, a sandbox uid; the worker still runs at most ``slots`` activations
    spare_sandboxes: int = Field(1, ge=0)

    def sandbox_spares(self) -> int:
        """Sandboxes a worker keeps beyond its slots: ``spare_sandboxes``, none without pre-started hosts
        (what a spare is for). The worker runs at most ``slots`` activations, so that many sandboxes are
        free at any time, and an activation takes the warmest free one (``workers.sandbox.SandboxPool
        .acquire``): a booted spare rather than the slot just released, whose host is booting."""
        return self.spare_sandboxes if self.prestart_hosts else 0
    #: the worker reads its GPUs' count and memory from this binary at registration when it exists on
    #: PATH (``workers.devices``); empty: never run it
    nvidia_smi: str = "nvidia-smi"
    #: a slot freed while two or more pre-started hosts are still free is refilled this much later (s):
    #: the activation that usually follows a suspend (a pressure suspend makes room for a waiting wake)
    #: then does not share the CPU with the refill's start-up (workers/sandbox.py, SandboxPool)
    prestart_refill_delay_s: float = Field(0.25, ge=0)


#: the shortest API key a file or env may give (``sk_`` and 16 more characters); ``keys create`` makes 55
MIN_API_KEY_CHARS = 19


class ApiKeySpec(_Section):
    """One API key given by file or env: its ``sha256`` (hex; preferred) or the ``key`` itself. Unknown
    fields are refused (``admn: true`` was ignored: the key lost its admin right without a word), and
    ``admin`` is a true boolean (the string ``"yes"`` was read as true)."""

    model_config = ConfigDict(extra="forbid")
    tenant: str
    sha256: str | None = None
    key: str | None = None
    admin: StrictBool = False
    name: str = ""

    @property
    def digest(self) -> str:
        """The key's SHA-256 as stored (lower-case hex): ``sha256`` normalised, or the hash of ``key``."""
        if self.key is not None:
            return hashlib.sha256(self.key.encode()).hexdigest()
        return (self.sha256 or "").lower().removeprefix("sha256:")

    @field_validator("name")
    @classmethod
    def _a_key_name(cls, v: str) -> str:
        if (why := key_name_problem(v)) is not None:
            raise ValueError(why)
        return v

    @field_validator("tenant")
    @classmethod
    def _a_tenant_name(cls, v: str) -> str:
        # checked here, at settings load, not when the keys are imported after the API started
        if not TENANT_RE.fullmatch(v):  # not match: "$" would let "team-a\n" through
            raise ValueError(f"invalid tenant name {v[:70]!r}: use 1-63 lower-case letters, digits and '-', starting and ending with a letter or digit")
        return v

    @model_validator(mode="after")
    def _a_hash_or_key(self) -> "ApiKeySpec":
        digest = (self.sha256 or "").lower().removeprefix("sha256:")
        if self.sha256 is not None and self.key is not None:
            raise ValueError(f"the key of tenant {self.tenant!r} has both `sha256` and `key`: give one of them")
        if self.sha256 is not None and not _HEX64.match(digest):
            # it was given: say what is wrong with it (it said "needs `sha256` ... or `key`": round 24)
            raise ValueError(f"the key of tenant {self.tenant!r} has a `sha256` that is not 64 hex digits "
                             f"({len(digest)} characters): give the key's SHA-256 in hex, or the key as `key`")
        if not (_HEX64.match(digest) or (not digest and self.key)):
            raise ValueError(f"the key of tenant {self.tenant!r} needs `sha256` (64 hex digits) or `key`")
        # the API looks a bearer token up as an API key only when it starts with ``sk_`` (api/auth.py):
        # another key was accepted here, closed the open API and could never log in (fresh-user run)
        if self.key is not None and not self.key.startswith("sk_"):
            raise ValueError(f"the key of tenant {self.tenant!r} must start with `sk_` (API keys are "
                             "sk_<id>_<secret>; `substrate keys create` makes one)")
        # ``sk_`` alone, or a few characters more, is a key anyone can guess (fresh-user round 10)
        if self.key is not None and len(self.key) < MIN_API_KEY_CHARS:
            raise ValueError(f"the key of tenant {self.tenant!r} is {len(self.key)} characters: an API key needs "
                             f"at least {MIN_API_KEY_CHARS}, or anyone can guess it (`substrate keys create` "
                             "makes keys of 55)")
        return self


def duplicate_api_key(specs: list[ApiKeySpec], places: list[str]) -> str | None:
    """What is wrong if two of ``specs`` give the same key (by its hash), naming both places (``places[i]``
    says where ``specs[i]`` was given) and tenants, never the key; None if none do. The second one was
    dropped without a word, and the key acted as the first one's tenant (fresh-user round 9)."""
    seen: dict[str, int] = {}
    named: dict[str, int] = {}
    for i, spec in enumerate(specs):
        j = seen.setdefault(spec.digest, i)
        if j != i:
            return (f"{places[i]} (tenant {spec.tenant!r}) gives the same key as {places[j]} (tenant "
                    f"{specs[j].tenant!r}): a key belongs to one tenant; give it once")
        # a given key's name is its ID (``keys list``, ``keys revoke``): two of one name made ``revoke``
        # take out the first and leave the other working without a word (fresh-user run)
        if spec.name and (j := named.setdefault(spec.name, i)) != i:
            return (f"{places[i]} (tenant {spec.tenant!r}) has the same name {spec.name!r} as {places[j]} "
                    f"(tenant {specs[j].tenant!r}): a key's name is its ID for `substrate keys revoke`; "
                    "give each key its own")
    return None


class AuthSettings(_Section):
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

    @field_validator("oidc_issuer", "oidc_jwks_url")
    @classmethod
    def _an_http_url(cls, v: str | None, info: Any) -> str | None:
        # 'not a url' was accepted, and every JWT was then refused 401 ``jwks_unavailable`` (fresh-user run)
        if v is not None:
            u = urlsplit(v)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ValueError(f"{info.field_name} must be an http:// or https:// URL with a host, got {v[:100]!r}")
        return v

    @field_validator("api_keys")
    @classmethod
    def _each_key_once(cls, v: list[ApiKeySpec]) -> list[ApiKeySpec]:
        if why := duplicate_api_key(v, [f"entry {i}" for i in range(len(v))]):
            raise ValueError(why)
        return v

    #: JWT claim naming the tenant, and the claim (list or space-separated string) holding roles
    tenant_claim: str = "tenant"
    roles_claim: str = "roles"
    admin_role: str = "substrate-admin"
    #: how long the JWKS is reused before a background reload (an unknown key ID reloads at once)
    jwks_ttl_s: float = Field(300.0, gt=0)
    #: safety net only: verified API keys are re-read after this long even without a revocation message
    key_cache_ttl_s: float = Field(30.0, gt=0)
    #: lifetime of per-activation tokens the control plane presents to workers
    activation_token_ttl_s: float = Field(300.0, gt=0)
    #: how often routers and workers re-read the activation-token signing keys
    signing_refresh_s: float = Field(5.0, gt=0)
    #: folder of credentials templates may ask for (``valueFrom.secretKeyRef``): files
    #: ``<dir>/<tenant>/<secret>/<key>`` or ``<dir>/<secret>/<key>`` (a mounted Kubernetes Secret)
    secrets_dir: Path | None = None


class QuotaSettings(_Section):
    """Limits per tenant (ActorTemplates add per-class limits in ``spec.quota``) and fairness knobs."""

    #: limits of a tenant not named in ``tenants``
    default: QuotaLimits = Field(default_factory=QuotaLimits)
    #: limits per tenant name (JSON in ``SUBSTRATE_QUOTA__TENANTS``; in the nested form
    #: ``SUBSTRATE_QUOTA__TENANTS__TEAM_A__MAXRUNNING`` an ``_`` stands for the ``-`` no variable name can hold)
    tenants: dict[str, QuotaLimits] = Field(default_factory=dict)

    @field_validator("tenants")
    @classmethod
    def _tenant_names(cls, v: dict[str, QuotaLimits]) -> dict[str, QuotaLimits]:
        """Every key a tenant name (a limit under any other key can never apply: it was accepted
        silently). ``team_a`` means ``team-a``: tenant names have no ``_``, variable names no ``-``."""
        out: dict[str, QuotaLimits] = {}
        for name, limits in v.items():
            tenant = name.replace("_", "-")
            if not TENANT_RE.match(tenant):
                raise ValueError(f"{name!r} is not a tenant name (1-63 lower-case letters, digits and '-', starting and ending with a letter or digit)")
            if tenant in out:
                raise ValueError(f"tenant {tenant!r} has two quota entries")
            out[tenant] = limits
        return out
    #: a create or wake refused by a full ``maxRunning`` (the tenant's, or its template's) first suspends
    #: the tenant's least recently used session idle at least ``api.pressure_min_idle_s`` (of that
    #: template, for the template's limit) and takes the freed place; 429 ``quota_max_running`` only if
    #: none is idle. False: refuse at once (the client suspends one itself)
    suspend_idle_for_running: bool = True
    #: share of ``api.max_parked`` one tenant's parked requests may take (fairness under a full pool)
    tenant_parked_share: float = Field(0.5, gt=0, le=1)
    #: circuit breaker: this many failed activations of one tenant within the window open it ...
    breaker_failures: int = Field(10, ge=1)
    breaker_window_s: float = Field(60.0, gt=0)
    #: ... for this long: creates and wakes of that tenant get 429 ``tenant_circuit_open``
    breaker_open_s: float = Field(30.0, ge=0)


class AuditSettings(_Section):
    #: records kept per tenant stream and per session stream (approximate trimming, MAXLEN ~)
    max_per_tenant: int = Field(100_000, ge=1)
    max_per_session: int = Field(1_000, ge=1)
    #: a deleted session's records stay queryable (by its tenant and admins) this long
    deleted_retention_s: float = Field(7 * 24 * 3600.0, ge=0)


_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")


def bucket_name_problem(name: str) -> str | None:
    """What is wrong with ``name`` as an S3 bucket name (the rules of ``SnapshotSettings.bucket``), or
    None: the settings and the WorkerPool's ``snapshotStorage`` URI check it alike."""
    if _BUCKET_RE.fullmatch(name) and ".." not in name:
        return None
    return (f"{name[:80]!r} is not an S3 bucket name: use 3-63 lower-case letters, digits, '.' or '-', "
            "starting and ending with a letter or digit")


class SnapshotSettings(_Section):
    store: Literal["local", "s3"] = "local"
    local_dir: Path = Path("var/snapshots")
    bucket: str = "agent-snapshots"
    prefix: str = "snapshots"
    endpoint_url: str | None = None

    @field_validator("endpoint_url")
    @classmethod
    def _an_endpoint_url(cls, v: str | None) -> str | None:
        # '127.0.0.1:9000' (no scheme) ended the start with botocore's "Invalid endpoint" traceback and exit 3
        # (fresh-user round 25); an empty value means none (AWS's own endpoint)
        if v is None or not v.strip():
            return None
        u = urlsplit(v)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"endpoint_url must be an http:// or https:// URL with a host (e.g. "
                             f"http://127.0.0.1:9000), got {v[:100]!r}")
        return v

    @field_validator("bucket")
    @classmethod
    def _a_bucket_name(cls, v: str) -> str:
        # S3's bucket naming rules (AWS S3 user guide, "General purpose bucket naming rules": 3-63
        # characters; lower-case letters, digits, '.' and '-'; a letter or digit at each end): a name
        # such as 'w' was taken at start and failed at the first suspend, 503 (found 2026-12-06)
        if why := bucket_name_problem(v):
            raise ValueError(why)
        return v

    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    multipart_threshold_bytes: int = Field(8 * 1024 * 1024, gt=0)
    #: committed snapshots kept per session (older ones are garbage-collected)
    retention: int = Field(2, ge=1)
    zstd_level: int = Field(3, le=22)
    #: create the bucket at start-up if it is missing (S3 store)
    create_bucket: bool = True
    #: record the configured store as the place of this directory's snapshots even if another one is
    #: recorded (the objects were moved there); without it such a start is refused (substrate/storeloc.py)
    accept_new_location: bool = False
    #: an object missing from a store that holds this directory's marker counts as lost (its session
    #: then falls back to its previous snapshot) only once it has been missing this long (s); until then
    #: a wake answers 503: a copy or move of the store may still be under way (snapshot/guard.py)
    missing_grace_s: float = Field(60.0, ge=0)
    #: the state manager's orphan sweep (objects no committed snapshot points at) runs this often
    sweep_interval_s: float = Field(300.0, gt=0)
    #: an object is deleted by the sweep only after it was found orphaned this long (an upload in
    #: flight is never taken for garbage)
    orphan_min_age_s: float = Field(900.0, ge=0)


class StateSettings(_Section):
    scan_interval_s: float = Field(1.0, gt=0)
    #: deadline for each transitional state; past it the session is recovered
    transition_deadline_s: float = Field(60.0, gt=0)
    #: resume a crashed worker's sessions eagerly instead of on the next request
    eager_recovery: bool = False
    suspend_retry_base_s: float = Field(0.5, gt=0)
    suspend_retry_max_s: float = Field(30.0, gt=0)
    #: the repair pass (every session read: recovery backstop, counters, quotas) runs every tenth scan,
    #: but no more often than keeps it under this share of the time: after a pass of ``t`` seconds the next
    #: waits at least ``t * (1 / repair_max_share - 1)``, so a directory too big to read every 10 s is
    #: read less often instead of keeping the state manager busy (O(sessions) work on a slow timer)
    repair_max_share: float = Field(0.05, gt=0, le=1)


def _backoff_max_checked(max_s: float, base_s: float | None, base_var: str) -> float:
    """``max_s`` if a back-off that starts at ``base_s`` (validated before it; None if it was invalid)
    can double up to it; else ValueError naming ``base_var``."""
    if base_s is not None and max_s < base_s:
        raise ValueError(f"({max_s:g}) must be at least {base_var} ({base_s:g}): the pause starts there and "
                         "doubles up to this maximum")
    return max_s


class PoolSettings(_Section):
    reconcile_interval_s: float = Field(1.0, gt=0)
    #: the pool shrinks only below the largest size wanted over this window (hysteresis): demand must
    #: have stayed lower this long. 10 s drained a burst's workers between its creates and its first
    #: turns on a loaded machine (fresh-user run, issue 11); Knative's stable window is 60 s, the HPA's
    #: scale-down stabilization 300 s. Replays of compressed traces set it lower (loadtest/bench.py)
    scale_down_delay_s: float = Field(30.0, ge=0)
    #: window of the activation arrival-rate forecast (creates + wakes per second)
    forecast_window_s: float = Field(30.0, gt=0)
    #: assumed create-to-READY time of a worker until one was measured
    lead_time_s: float = Field(0.5, ge=0)
    #: local backend: a worker process that exits on its own (a crash; a port range taken by other
    #: programs, where it cannot listen) is replaced at once the first time in a row; from the second, the
    #: pool's next worker start is held back this long, doubling with each further exit up to
    #: ``restart_backoff_max_s`` (``substrate.backends.backoff``; the Kubernetes
    #: backend's are ``kubernetes.failure_backoff_s``). Without it a worker that could not start was
    #: started again every round (58 times in 30 s) and creates waited 30 s for it
    restart_backoff_s: float = Field(0.5, ge=0)
    restart_backoff_max_s: float = Field(60.0, ge=0)
    #: a worker started this long ago that has not registered counts no more as capacity on its way; the
    #: local backend kills it (frozen or hung in its start: it holds no session) and counts a failed start.
    #: A Pod that has not registered is left to Kubernetes (a Pending Pod is the scheduler's)
    start_timeout_s: float = Field(60.0, gt=0)

    @field_validator("restart_backoff_max_s")
    @classmethod
    def _restart_max_not_below_start(cls, v: float, info: Any) -> float:
        return _backoff_max_checked(v, info.data.get("restart_backoff_s"), "SUBSTRATE_POOL__RESTART_BACKOFF_S")
    #: how often a router process writes its waiting placements to Redis for the pool controller while
    #: any wait (``substrate.demand``); the first wait of a burst is written at once
    demand_publish_s: float = Field(0.5, gt=0)
    #: demand and capacity notes older than this are ignored (a router or controller that died)
    demand_ttl_s: float = Field(5.0, gt=0)
    #: free slots a router keeps in each pool by suspending the least recently used idle sessions (idle
    #: at least ``api.pressure_min_idle_s``) right after a placement left fewer, in the background, so
    #: that the next create or wake finds a slot instead of waiting for a suspension on its own path
    #: (on the 11-21 replay 27 % of activations waited for one). Never while the pool grows. 0: only
    #: on need (lazy suspension)
    headroom_slots: int = Field(0, ge=0)
    #: which worker a placement prefers among those with a warm free slot (``substrate.placement``):
    #: ``spread`` the most free slots, ``pack`` the fewest (the emptier workers run dry and drain
    #: without suspending anyone)
    placement: Literal["spread", "pack"] = "spread"
    #: at most max(this, READY workers) workers of an autoscaled pool starting at once (the pool at most
    #: doubles per worker start; the HPA's default scale-up policy is 4 Pods or 100 %); 0: no limit. On
    #: 2 cores, 100 concurrent creates on an empty pool (the Azure trace at 20x) started 17 workers at
    #: once, whose boots took the CPU the creates needed: create p99 11.8 s against 9.0 s with 4
    #: (docs/replays/azure-conv/report-2026-12-05-scale-up-step-ab.md)
    scale_up_step: int = Field(4, ge=0)
    #: the most worker processes the local backend (``substrate up``) may be asked to run, all pools
    #: together (each pool's ``spec.replicas``, or ``spec.autoscaling.maxReplicas`` when it has one):
    #: a config asking for more is refused at start (``substrate.backends.local.check_capacity``). Each
    #: worker is a Python process (tens of MiB); a fresh-user run's ``replicas: 100000`` forked ~830
    #: within 2 minutes and took a 2-core machine down with it. The baseline replay keeps up to 400
    local_max_workers: int = Field(512, ge=1)


class KubernetesSettings(_Section):
    """The Kubernetes mode (``substrate router|controller`` on a cluster; see docs/kubernetes.md).

    ``api_url`` unset: in-cluster service-account config, else ``~/.kube/config``. Workers get the
    connection settings through their Pod: Redis URL and internal token from Secrets (names below; empty
    name = the value of this process is copied into the Pod as a literal, for tests and dev clusters)."""

    namespace: str = "agent-substrate"
    api_url: str | None = None
    #: a Lease in ``namespace``; standbys take over within ``lease_duration_s`` of the leader's last renewal
    lease_name: str = "substrate-controller"
    lease_duration_s: float = Field(15.0, gt=0)
    lease_renew_s: float = Field(5.0, gt=0)
    #: the image worker Pods run when the pool's template names none
    worker_image: str = "ghcr.io/agent-substrate/substrate:0.1.0"
    worker_port: int = Field(8081, ge=1, le=65535)
    #: where the worker's workspace volume is mounted (an emptyDir unless the template brings one)
    worker_root: str = "/var/lib/substrate"
    redis_secret: str = "substrate-redis"
    token_secret: str = "substrate-internal-token"
    #: workers replaced at once when a pool's pod template changes
    max_surge: int = Field(1, ge=1)
    #: Pod creates one controller runs at once (a pool scaled by N creates N Pods in parallel up to this)
    create_concurrency: int = Field(8, ge=1, le=64)
    #: a Pod Unschedulable this long puts the pool's condition ``PodsSchedulable`` to False
    unschedulable_grace_s: float = Field(10.0, ge=0)
    #: back-off between re-creations of failing Pods of one pool, from the second failure in a row (the
    #: first is re-created at once; doubles up to the max)
    failure_backoff_s: float = Field(1.0, ge=0)
    failure_backoff_max_s: float = Field(60.0, ge=0)

    @field_validator("failure_backoff_max_s")
    @classmethod
    def _failure_max_not_below_start(cls, v: float, info: Any) -> float:
        return _backoff_max_checked(v, info.data.get("failure_backoff_s"), "SUBSTRATE_KUBERNETES__FAILURE_BACKOFF_S")


class Settings(BaseSettings):
    """The whole configuration tree. Construct with keyword overrides in tests."""

    model_config = SettingsConfigDict(env_prefix="SUBSTRATE_", env_nested_delimiter="__", extra="ignore",
                                      allow_inf_nan=False)

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
    #: the one folder for runtime data of the embedded default: ``redis/`` (the embedded Redis' append-only
    #: file), ``workers/`` (workspaces) and ``snapshots/`` (the local snapshot store) unless
    #: ``redis.data_dir`` / ``worker.root_dir`` / ``snapshot.local_dir`` are set
    data_dir: Path = Path("var")
    #: where templates and pools come from: ``files`` (config_dir) or ``kubernetes`` (the API server)
    catalog_source: Literal["files", "kubernetes"] = "files"
    #: what ``api.main:app`` runs: ``embedded`` (substrate up) or ``router`` (API + proxy only)
    role: Literal["embedded", "router"] = "embedded"
    #: one of DEBUG, INFO, WARNING, ERROR, CRITICAL (any case)
    log_level: str = "INFO"
    log_json: bool = True

    @field_validator("log_level")
    @classmethod
    def _a_log_level(cls, v: str) -> str:
        # an unknown level was a 49-line traceback from logging at start-up (a fresh-user run)
        if v.strip().upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"{v[:40]!r} is not a log level: use DEBUG, INFO, WARNING, ERROR or CRITICAL")
        return v.strip().upper()

    @model_validator(mode="before")
    @classmethod
    def _empty_paths_are_unset(cls, data: object) -> object:
        # SUBSTRATE_DATA_DIR= (empty) was Path("."): redis/, workers/ and snapshots/ in the current folder
        return _drop_empty_paths(cls, data)

    def model_post_init(self, __context: object) -> None:
        short = os.environ.get("SUBSTRATE_REDIS_URL")
        if short and not self.redis.url:
            if why := redis_url_problem(short):  # the alias bypasses RedisSettings' own check
                raise ValueError(f"SUBSTRATE_REDIS_URL: {why}")
            self.redis.url = short
        # every folder follows data_dir: a Redis left in ./var while snapshots moved made session records
        # point at snapshots that are not there (fresh-user run)
        if "data_dir" not in self.redis.model_fields_set:
            self.redis.data_dir = self.data_dir / "redis"
        if "root_dir" not in self.worker.model_fields_set:
            self.worker.root_dir = self.data_dir / "workers"
        if "local_dir" not in self.snapshot.model_fields_set:
            self.snapshot.local_dir = self.data_dir / "snapshots"


def _is_path(annotation: object) -> bool:
    """Whether ``annotation`` is ``Path`` or ``Path | None``."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return annotation is Path or (union and Path in typing.get_args(annotation))


def _drop_empty_paths(model: type[BaseModel], data: object) -> object:
    """``data`` (the raw input of ``model``) without the empty strings given for its folder and file fields, in
    nested models too: an empty variable means the default, as if it were unset."""
    if not isinstance(data, dict):
        return data
    out = {}
    for k, v in data.items():
        info = model.model_fields.get(k)
        if info is not None and _is_path(info.annotation) and isinstance(v, str) and not v.strip():
            continue
        sub = _model_of(info.annotation) if info is not None else None
        out[k] = _drop_empty_paths(sub, v) if sub is not None else v
    return out


def _field_at(path: list[str]) -> typing.Any:
    """The annotation of the setting at ``path`` (lower-case field names from the root), or None."""
    model: type[BaseModel] | None = Settings
    annotation: typing.Any = None
    for part in path:
        info = model.model_fields.get(part) if model is not None else None
        if info is None:
            return None
        annotation = info.annotation
        model = _model_of(annotation)
    return annotation


def _is_complex(annotation: object) -> bool:
    """Whether pydantic-settings reads a value of this type from the environment as JSON."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for a in (annotation, *(typing.get_args(annotation) if union else ())):
        if _model_of(a) is not None or typing.get_origin(a) in (list, dict, set, tuple) or a in (list, dict):
            return True
    return False


def bad_json_env(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """``SUBSTRATE_`` variables whose setting takes JSON (a list, a mapping, a nested model) but whose value
    is not JSON, each with what is wrong, sorted: pydantic-settings names only the top-level field of such a
    variable (``SettingsError: error parsing value for field "quota"``), not the variable."""
    out: list[tuple[str, str]] = []
    for var in sorted(environ):
        if not var.upper().startswith("SUBSTRATE_") or not environ[var].strip():
            continue
        annotation = _field_at(var.upper().removeprefix("SUBSTRATE_").lower().split("__"))
        if annotation is None or not _is_complex(annotation):
            continue
        try:
            json.loads(environ[var])
        except ValueError as e:
            out.append((var, f"not valid JSON ({e})"))
    return out


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Process-wide settings, read once from the environment."""
    return Settings()


#: ``SUBSTRATE_`` variables read outside the settings model: the short Redis alias, the CLI client, the
#: ``substrate worker`` options and its Pod's downward API, the lifeline pipe, the agent host, the tests and
#: the load tests
ENV_READ_ELSEWHERE = frozenset({
    "SUBSTRATE_REDIS_URL", "SUBSTRATE_SERVER", "SUBSTRATE_TOKEN",
    "SUBSTRATE_WORKER_POOL", "SUBSTRATE_WORKER_SLOTS", "SUBSTRATE_WORKER_PORT", "SUBSTRATE_WORKER_LISTEN_HOST",
    "SUBSTRATE_POD_IP", "SUBSTRATE_POD_NAME", "SUBSTRATE_LIFELINE_FD", "SUBSTRATE_SESSION_ID",
    "SUBSTRATE_TEST_REDIS_URL", "SUBSTRATE_LOAD_SHAPE", "SUBSTRATE_TIME_COMPRESSION", "SUBSTRATE_SHAPE_DURATION_S",
    "SUBSTRATE_COUNTER_TEMPLATE", "SUBSTRATE_NOTEBOOK_TEMPLATE", "SUBSTRATE_BURST_BASE_USERS",
    "SUBSTRATE_BURST_PEAK_USERS", "SUBSTRATE_BURST_PERIOD_S", "SUBSTRATE_BURST_LEN_S", "SUBSTRATE_BURST_SPAWN_RATE",
})


def _model_of(annotation: object) -> type[BaseModel] | None:
    """The BaseModel class ``annotation`` names (also inside ``X | None``, never inside a dict or list), else
    None."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for a in (annotation, *(typing.get_args(annotation) if union else ())):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def setting_env_names(model: type[BaseModel] = Settings, prefix: str = "SUBSTRATE_") -> tuple[set[str], set[str]]:
    """The environment variables the settings model reads: (exact names, prefixes of open-ended names).

    Every field is a name (a nested model also as a whole, in JSON); a nested model's fields follow with
    ``__``; a dict or list field also takes ``NAME__<anything>`` (pydantic-settings nests into it)."""
    names: set[str] = set()
    open_prefixes: set[str] = set()
    for field_name, info in model.model_fields.items():
        name = prefix + field_name.upper()
        names.add(name)
        sub = _model_of(info.annotation)
        if sub is not None:
            sub_names, sub_open = setting_env_names(sub, name + "__")
            names |= sub_names
            open_prefixes |= sub_open
        elif typing.get_origin(info.annotation) in (dict, list):
            open_prefixes.add(name + "__")
    return names, open_prefixes


def unknown_env(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``SUBSTRATE_`` variables in ``environ`` that nothing reads (a typo is otherwise silently ignored), each
    with the closest known name or None, sorted. Names are compared case-insensitively, as pydantic-settings
    reads them."""
    names, open_prefixes = setting_env_names()
    known = names | ENV_READ_ELSEWHERE
    out: list[tuple[str, str | None]] = []
    for var in sorted(environ):
        up = var.upper()
        if not up.startswith("SUBSTRATE_") or up in known or up.startswith(tuple(open_prefixes)):
            continue
        # compare without the common prefix: every candidate shares it, which would make any name "close"
        close = closest(up.removeprefix("SUBSTRATE_"), [k.removeprefix("SUBSTRATE_") for k in known])
        out.append((var, "SUBSTRATE_" + close if close else None))
    return out


def closest(word: str, candidates: typing.Iterable[str], cutoff: float = 0.75) -> str | None:
    """The candidate ``word`` is most likely a misspelling of (``difflib`` ratio at least ``cutoff``), or
    None: the project's one "did you mean" (unknown variables, fields inside a JSON value, spec kinds and
    fields in ``substrate.specs``)."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=cutoff)
    return close[0] if close else None


def _inner(annotation: object, part: object) -> object:
    """The annotation one step of a pydantic error location below ``annotation``: a model's field, a
    dict's values, a list's items; None when ``part`` does not fit."""
    model = _model_of(annotation)
    if model is not None:
        info = model.model_fields.get(str(part))
        return info.annotation if info is not None else None
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    for a in (annotation, *(typing.get_args(annotation) if union else ())):
        args = typing.get_args(a)
        if typing.get_origin(a) is dict and len(args) == 2:
            return args[1]
        if typing.get_origin(a) in (list, tuple, set) and args and isinstance(part, int):
            return args[0]
    return None


def fields_at(loc: typing.Sequence[Any], root: object = None) -> list[str]:
    """The field names (aliases where set) of the model a pydantic error location ``loc`` lies in
    (``loc[:-1]`` names it from ``root``, by default ``Settings``; ``substrate.specs`` passes a spec
    model), or [] when that is no model."""
    annotation: object = Settings if root is None else root
    for part in loc[:-1]:
        annotation = _inner(annotation, part)
    model = _model_of(annotation)
    return [f.alias or n for n, f in model.model_fields.items()] if model is not None else []


def env_var_of(loc: typing.Sequence[Any], environ: Mapping[str, str]) -> tuple[str, tuple[Any, ...]] | None:
    """The ``SUBSTRATE_`` variable set in ``environ`` that holds the setting at the pydantic error location
    ``loc``, as spelt there, and the rest of ``loc`` (the path inside its JSON value); None if none is set.
    ``("quota", "default", "maxRuning")`` from ``SUBSTRATE_QUOTA__DEFAULT='{"maxRuning":3}'`` is that
    variable and ``("maxRuning",)``: naming ``SUBSTRATE_QUOTA__DEFAULT__MAXRUNING`` sent users looking for a
    variable they never set."""
    spelt = {k.upper(): k for k in environ}
    found: list[tuple[str, tuple[Any, ...]]] = []
    for i in range(len(loc), 0, -1):
        if not all(isinstance(p, str) for p in loc[:i]):
            continue
        var = spelt.get("SUBSTRATE_" + "__".join(str(p).upper() for p in loc[:i]))
        if var is not None:
            found.append((var, tuple(loc[i:])))
    # with several set (SUBSTRATE_QUOTA and SUBSTRATE_QUOTA__DEFAULT), the one whose value holds the
    # field: the deepest was blamed for a typo in the other's JSON (fresh-user round 8)
    for var, inner in found:
        if _json_holds(environ[var], inner):
            return var, inner
    return found[0] if found else None


def _json_holds(text: str, path: tuple[Any, ...]) -> bool:
    """Whether the JSON ``text`` has something at ``path`` (keys and list indexes); an empty path: any
    value. False for text that is not JSON."""
    if not path:
        return True
    try:
        value: Any = json.loads(text)
    except ValueError:
        return False
    for part in path:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            value = value[part]
        else:
            return False
    return True


def unknown_json_fields(environ: Mapping[str, str]) -> list[tuple[str, str, str | None]]:
    """Fields inside the JSON value of a ``SUBSTRATE_`` variable that names a group of settings
    (``SUBSTRATE_QUOTA='{"defualt": {...}}'``) that no setting reads: a group ignores fields it does not
    have, so such a typo was silently ignored. Each as (the variable as spelt, the field's path in the
    value, the closest field there or None), sorted. Values that are not JSON objects, and groups that
    refuse unknown fields themselves (an error names those), are left out."""
    spelt = {k.upper(): k for k in environ}
    out: list[tuple[str, str, str | None]] = []

    def walk(var: str, model: type[BaseModel], value: dict[str, Any], path: str) -> None:
        if model.model_config.get("extra") == "forbid":
            return  # pydantic refuses them with an error line of its own
        known: dict[str, object] = {}
        for name, info in model.model_fields.items():
            for alias in (name, info.alias, info.validation_alias):
                if isinstance(alias, str):
                    known[alias] = info.annotation
        for key, sub in value.items():
            where = f"{path}.{key}" if path else str(key)
            if key not in known:
                out.append((var, where, closest(str(key), [k for k in known if not k.startswith("_")])))
            elif isinstance(sub, dict) and (inner := _model_of(known[key])) is not None:
                walk(var, inner, sub, where)

    def visit(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            sub = _model_of(info.annotation)
            if sub is None:
                continue
            env = prefix + name.upper()
            var = spelt.get(env)
            if var is not None:
                try:
                    value = json.loads(environ[var])
                except ValueError:
                    value = None  # not JSON: an error line says so
                if isinstance(value, dict):
                    walk(var, sub, value, "")
            visit(sub, env + "__")

    visit(Settings, "SUBSTRATE_")
    return sorted(out)
