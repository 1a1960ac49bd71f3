"""Request traces -> agent-session turns, for time-compressed replay.

Every loader produces the same thing: a list of :class:`Turn`, sorted by arrival.

    Turn(session_owner: str, arrival_s: float, duration_s: float, ok: bool)

- ``session_owner``: who the turn belongs to (a user, a trajectory); one owner yields one or more
  sessions once :func:`split_sessions` cuts its turns at idle gaps.
- ``arrival_s``: when the turn arrived, in seconds **on the trace's own clock**. For timestamped
  formats (GenTD26, Azure, OpenHands) that is Unix time in seconds (naive timestamps are read as
  UTC); for the plain CSV it is whatever the file says (normally seconds from 0).
- ``duration_s``: how long the turn keeps a worker slot busy (trace seconds, >= 0).
- ``ok``: False when the trace recorded the request as failed.

Supported formats (auto-detected from the extension and the CSV header; ``fmt=`` overrides):

``gentd26``
    Alibaba GenTD26 request CSV. Header includes ``gmt_create`` (arrival, 1 s resolution),
    ``exec_time_seconds`` (duration), ``groupId`` (owner) and ``predict_status``; a status other
    than ``SUCCEED`` (``FAILED``, ``PENDING``) is a failed turn.
``azure``
    Azure LLM inference CSV: ``TIMESTAMP,ContextTokens,GeneratedTokens``. It has no session id,
    so owners are synthetic (see :class:`AzureOptions`): row *i* goes to owner
    ``az{k:04d}`` with ``k = blake2b(f"{seed}:{i}") mod K`` (``scheme="hash"``, the default:
    a stable, uniform random assignment; every run with the same seed and K agrees) or
    ``k = i mod K`` (``scheme="roundrobin"``). Duration is estimated from the tokens:
    ``ContextTokens / prefill_tokens_per_s + GeneratedTokens / decode_tokens_per_s``.
``openhands``
    OpenHands trajectories: a ``.json`` file holding one event list (or a dict with
    ``history``, or a list of such dicts) or a ``.jsonl`` file with one evaluation output
    (``instance_id``, ``history``) per line. One trajectory = one owner (its ``instance_id``,
    else ``<file stem>`` / ``<file stem>:<line>``). A turn is a tool call: an action event
    answered by an observation whose ``cause`` is the action's ``id``; arrival = the action's
    timestamp, duration = observation timestamp - action timestamp (tool run time). The gap
    before the next action is model think time (idle for the worker). Bookkeeping observations
    (``null``, ``agent_state_changed``) are not turns. An ``error`` observation is a failed turn
    (duration 0 when it has no cause). A command with a non-zero exit code is still ``ok``:
    the sandbox served it.
``plain``
    ``session_id,arrival_s,duration_s`` CSV (optional ``ok`` column: 1/0/true/false); the
    session id is the owner.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

FORMATS = ("gentd26", "azure", "openhands", "plain")
TIMESTAMPED_FORMATS = frozenset({"gentd26", "azure", "openhands"})


class TraceError(ValueError):
    """A trace file could not be read or understood."""


@dataclass(frozen=True, slots=True, order=True)
class Turn:
    """One request of a trace. Field order makes ``sorted()`` sort by arrival (then owner)."""

    arrival_s: float
    session_owner: str
    duration_s: float
    ok: bool = True

    def __init__(self, session_owner: str, arrival_s: float, duration_s: float, ok: bool = True):
        object.__setattr__(self, "session_owner", str(session_owner))
        object.__setattr__(self, "arrival_s", float(arrival_s))
        object.__setattr__(self, "duration_s", max(0.0, float(duration_s)))
        object.__setattr__(self, "ok", bool(ok))

    @property
    def end_s(self) -> float:
        """Arrival + duration (trace seconds)."""
        return self.arrival_s + self.duration_s


@dataclass(frozen=True, slots=True)
class AzureOptions:
    """How the Azure loader invents owners and durations (the trace has neither)."""

    owners: int = 100
    scheme: str = "hash"  # "hash" | "roundrobin"
    seed: int = 0
    prefill_tokens_per_s: float = 5000.0
    decode_tokens_per_s: float = 50.0


# ---------------------------------------------------------------------------------------------
# time parsing


_FRACTION = re.compile(r"(\.\d{6})\d+")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d|w)?", re.IGNORECASE)
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_timestamp(text: str) -> float:
    """ISO-8601-ish timestamp -> Unix seconds. Naive times are UTC; >6 fraction digits are cut."""
    s = text.strip()
    if s.endswith("Z"):
        s = s[:-1] + "+00:00"
    s = _FRACTION.sub(r"\1", s)
    try:
        dt = datetime.fromisoformat(s)
    except ValueError as e:
        raise TraceError(f"bad timestamp {text!r}") from e
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def format_timestamp(unix_s: float) -> str:
    """Unix seconds -> ``YYYY-MM-DDTHH:MM:SSZ`` (UTC)."""
    return datetime.fromtimestamp(unix_s, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_duration(text: str | float) -> float:
    """``"1d"``, ``"30m"``, ``"1h30m"``, ``"90s"``, ``"250ms"``, ``"45"`` (seconds) -> seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    s = text.strip().replace(" ", "")
    if not s:
        raise ValueError("empty duration")
    pos, total = 0, 0.0
    while pos < len(s):
        m = _DURATION_PART.match(s, pos)
        if not m or m.end() == pos:
            raise ValueError(f"bad duration {text!r} (use e.g. 90s, 30m, 2h, 1d, 1h30m)")
        total += float(m.group(1)) * _UNIT_S[(m.group(2) or "s").lower()]
        pos = m.end()
    return total


def looks_like_date(text: str) -> bool:
    return bool(re.match(r"^\d{4}-\d{2}-\d{2}", text.strip()))


def resolve_start(spec: str | float | None, first_arrival_s: float, timestamped: bool) -> float:
    """Window start on the trace clock.

    ``None`` -> the first arrival; a date/time (``2024-11-20``, ``2024-11-20T08:00``) -> that
    instant (timestamped formats only); anything else is a duration offset from the first arrival
    (``"2d"``, ``"3600"``).
    """
    if spec is None or spec == "":
        return first_arrival_s
    if isinstance(spec, str) and looks_like_date(spec):
        if not timestamped:
            raise TraceError("an absolute --start needs a timestamped trace; give an offset (e.g. 2h)")
        return parse_timestamp(spec)
    return first_arrival_s + parse_duration(spec)


# ---------------------------------------------------------------------------------------------
# format detection and loaders


def detect_format(path: str | Path) -> str:
    """Guess the trace format from the file extension and (for CSV) the header row."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "openhands"
    with p.open(newline="", encoding="utf-8-sig") as f:
        header = next(csv.reader(f), [])
    cols = {c.strip() for c in header}
    lower = {c.lower() for c in cols}
    if {"gmt_create", "groupId"} <= cols or {"gmt_create", "groupid"} <= lower:
        return "gentd26"
    if "TIMESTAMP" in cols or {"timestamp", "contexttokens"} <= lower:
        return "azure"
    if {"session_id", "arrival_s"} <= lower:
        return "plain"
    raise TraceError(f"cannot tell the format of {p.name} from its header {header!r}; pass --format")


def _read_csv(path: Path) -> Iterable[dict[str, str]]:
    with path.open(newline="", encoding="utf-8-sig") as f:
        yield from csv.DictReader(f)


def _float(row: dict[str, str], key: str, default: float = 0.0) -> float:
    v = (row.get(key) or "").strip()
    if not v:
        return default
    x = float(v)
    return x if math.isfinite(x) else default


def load_gentd26(path: str | Path) -> list[Turn]:
    """GenTD26 CSV -> turns (owner ``groupId``, arrival ``gmt_create``, ``exec_time_seconds``)."""
    turns = []
    for row in _read_csv(Path(path)):
        if not row.get("gmt_create"):
            continue
        turns.append(
            Turn(
                session_owner=row["groupId"],
                arrival_s=parse_timestamp(row["gmt_create"]),
                duration_s=_float(row, "exec_time_seconds"),
                ok=(row.get("predict_status") or "").strip().upper() == "SUCCEED",
            )
        )
    turns.sort()
    return turns


def azure_owner(row_index: int, opts: AzureOptions) -> str:
    """The synthetic owner of Azure row ``row_index`` (0-based data row) under ``opts``."""
    k = max(1, int(opts.owners))
    if opts.scheme == "roundrobin":
        idx = row_index % k
    elif opts.scheme == "hash":
        digest = hashlib.blake2b(f"{opts.seed}:{row_index}".encode(), digest_size=8).digest()
        idx = int.from_bytes(digest, "big") % k
    else:
        raise TraceError(f"unknown azure owner scheme {opts.scheme!r} (hash | roundrobin)")
    return f"az{idx:04d}"


def load_azure(path: str | Path, opts: AzureOptions | None = None) -> list[Turn]:
    """Azure LLM inference CSV -> turns with synthetic owners and token-derived durations."""
    opts = opts or AzureOptions()
    turns = []
    for i, row in enumerate(_read_csv(Path(path))):
        ts = row.get("TIMESTAMP") or row.get("timestamp")
        if not ts:
            continue
        duration = _float(row, "ContextTokens") / opts.prefill_tokens_per_s + _float(
            row, "GeneratedTokens"
        ) / opts.decode_tokens_per_s
        turns.append(Turn(azure_owner(i, opts), parse_timestamp(ts), duration, True))
    turns.sort()
    return turns


_OPENHANDS_NOT_WORK = frozenset({"null", "agent_state_changed"})


def openhands_turns(events: Sequence[dict], owner: str) -> list[Turn]:
    """One OpenHands event list (``history``) -> its tool-call turns (see module docstring)."""
    by_id = {e["id"]: e for e in events if isinstance(e, dict) and "id" in e}
    turns = []
    for e in events:
        if not isinstance(e, dict):
            continue
        obs = e.get("observation")
        if obs is None or obs in _OPENHANDS_NOT_WORK or "timestamp" not in e:
            continue
        t_obs = parse_timestamp(e["timestamp"])
        action = by_id.get(e.get("cause")) if e.get("cause") is not None else None
        if action is not None and "action" in action and "timestamp" in action:
            t_act = parse_timestamp(action["timestamp"])
            turns.append(Turn(owner, t_act, max(0.0, t_obs - t_act), obs != "error"))
        elif obs == "error":
            turns.append(Turn(owner, t_obs, 0.0, False))
    return turns


def _trajectories(obj: object, stem: str) -> Iterable[tuple[str, list[dict]]]:
    """Yield (owner, events) from the JSON shapes OpenHands writes."""
    if isinstance(obj, dict):
        if isinstance(obj.get("history"), list):
            yield str(obj.get("instance_id") or stem), obj["history"]
        return
    if isinstance(obj, list):
        if obj and all(isinstance(x, dict) and "history" in x for x in obj):
            for i, x in enumerate(obj):
                yield from _trajectories(x, f"{stem}:{i}")
        else:
            yield stem, [x for x in obj if isinstance(x, dict)]


def load_openhands(path: str | Path) -> list[Turn]:
    """OpenHands ``.json`` / ``.jsonl`` trajectories -> turns (one owner per trajectory)."""
    p = Path(path)
    turns: list[Turn] = []
    text = p.read_text(encoding="utf-8")
    if p.suffix.lower() == ".jsonl":
        for n, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                for owner, events in _trajectories(json.loads(line), f"{p.stem}:{n}"):
                    turns.extend(openhands_turns(events, owner))
    else:
        for owner, events in _trajectories(json.loads(text), p.stem):
            turns.extend(openhands_turns(events, owner))
    turns.sort()
    return turns


def _truthy(v: str | None) -> bool:
    return (v or "1").strip().lower() not in ("0", "false", "no", "n", "f", "failed", "error")


#: the longest turn a plain trace may hold (s): a day; a typo such as 1e9 planned 10 million seconds of
#: wall time without a word (fresh-user round 10)
MAX_TURN_S = 86_400.0


def load_plain(path: str | Path) -> list[Turn]:
    """``session_id,arrival_s,duration_s[,ok]`` CSV -> turns. Raises ``TraceError`` naming the line for a
    missing column, a value that is not a finite number, a negative one, or a turn longer than
    ``MAX_TURN_S`` (a bad number said only ``could not convert string to float``, and negative, NaN or
    infinite values were taken or dropped silently: fresh-user round 10)."""
    p = Path(path)
    turns = []
    with p.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        columns = {(c or "").strip().lower() for c in reader.fieldnames or ()}
        missing = [c for c in ("session_id", "arrival_s", "duration_s") if c not in columns]
        if missing:
            raise TraceError(f"{p}: a plain trace needs the columns session_id, arrival_s, duration_s; "
                             f"missing: {', '.join(missing)}")
        for row in reader:
            line = reader.line_num
            row = {k.strip().lower(): v for k, v in row.items() if k}
            if not (row.get("session_id") or "").strip():
                continue
            values = {}
            for key in ("arrival_s", "duration_s"):
                text = (row.get(key) or "").strip()
                try:
                    values[key] = float(text)
                except ValueError:
                    raise TraceError(f"{p} line {line}: {key} {text[:40]!r} is not a number") from None
                if not math.isfinite(values[key]) or values[key] < 0:
                    raise TraceError(f"{p} line {line}: {key} {text[:40]!r} must be a finite number >= 0")
            if values["duration_s"] > MAX_TURN_S:
                raise TraceError(f"{p} line {line}: duration_s {values['duration_s']:g} is more than a day "
                                 f"({MAX_TURN_S:g} s): a typo?")
            turns.append(Turn(row["session_id"], values["arrival_s"], values["duration_s"], _truthy(row.get("ok"))))
    turns.sort()
    return turns


def load_trace(path: str | Path, fmt: str | None = None, *, azure: AzureOptions | None = None) -> list[Turn]:
    """Load any supported trace; ``fmt`` (one of :data:`FORMATS`) overrides auto-detection."""
    p = Path(path)
    if not p.exists():
        raise TraceError(f"no such trace file: {p}")
    fmt = fmt or detect_format(p)
    if fmt == "gentd26":
        return load_gentd26(p)
    if fmt == "azure":
        return load_azure(p, azure)
    if fmt == "openhands":
        return load_openhands(p)
    if fmt == "plain":
        return load_plain(p)
    raise TraceError(f"unknown trace format {fmt!r}; choose one of {', '.join(FORMATS)}")


# ---------------------------------------------------------------------------------------------
# window, sessions, compression


def select_window(turns: Sequence[Turn], start_s: float | None = None, duration_s: float | None = None) -> list[Turn]:
    """Turns with ``start_s <= arrival_s < start_s + duration_s`` (trace clock; None = unbounded)."""
    lo = -math.inf if start_s is None else start_s
    hi = math.inf if duration_s is None else lo + duration_s
    return [t for t in turns if lo <= t.arrival_s < hi]


@dataclass(frozen=True, slots=True)
class Session:
    """A run of one owner's turns with no idle gap longer than the split.

    ``key`` is ``"{owner}#{n}"`` (n = 0, 1, ... per owner, in time order).
    """

    key: str
    owner: str
    turns: tuple[Turn, ...] = field(default_factory=tuple)

    @property
    def start_s(self) -> float:
        """First arrival (trace seconds)."""
        return self.turns[0].arrival_s

    @property
    def last_end_s(self) -> float:
        """Latest turn end (trace seconds)."""
        return max(t.end_s for t in self.turns)

    def hold_s(self, idle_split_s: float) -> float:
        """Seconds an always-on worker holds this session: first arrival -> last end + idle split."""
        return self.last_end_s + idle_split_s - self.start_s

    def think_s(self) -> list[float]:
        """Idle gaps between turns (next arrival - end of the work before it, >= 0)."""
        gaps, busy_until = [], self.turns[0].end_s
        for t in self.turns[1:]:
            gaps.append(max(0.0, t.arrival_s - busy_until))
            busy_until = max(busy_until, t.end_s)
        return gaps


def split_sessions(turns: Iterable[Turn], idle_split_s: float) -> list[Session]:
    """Owners -> sessions. A new session starts when a turn arrives more than ``idle_split_s``
    after the end of all earlier work of the same owner's current session (a gap of exactly the
    split stays in the session). Sessions come back sorted by start, then key."""
    by_owner: dict[str, list[Turn]] = {}
    for t in sorted(turns):
        by_owner.setdefault(t.session_owner, []).append(t)
    sessions: list[Session] = []
    for owner, owned in by_owner.items():
        current: list[Turn] = []
        busy_until = -math.inf
        n = 0
        for t in owned:
            if current and t.arrival_s - busy_until > idle_split_s:
                sessions.append(Session(f"{owner}#{n}", owner, tuple(current)))
                n += 1
                current = []
                busy_until = -math.inf
            current.append(t)
            busy_until = max(busy_until, t.end_s)
        if current:
            sessions.append(Session(f"{owner}#{n}", owner, tuple(current)))
    sessions.sort(key=lambda s: (s.start_s, s.key))
    return sessions


def compress(turns: Iterable[Turn], factor: float, origin_s: float | None = None) -> list[Turn]:
    """Time-compress: ``arrival -> (arrival - origin) / factor``, ``duration -> duration / factor``.

    ``origin_s`` defaults to the first arrival, so the result starts at 0 (wall seconds).
    """
    if factor <= 0:
        raise ValueError("compression factor must be > 0")
    ts = sorted(turns)
    if not ts:
        return []
    origin = ts[0].arrival_s if origin_s is None else origin_s
    return [Turn(t.session_owner, (t.arrival_s - origin) / factor, t.duration_s / factor, t.ok) for t in ts]


def describe(turns: Sequence[Turn]) -> dict[str, float | int]:
    """Small summary: turns, owners, span_s, failed, busy_s (sum of durations)."""
    if not turns:
        return {"turns": 0, "owners": 0, "span_s": 0.0, "failed": 0, "busy_s": 0.0}
    return {
        "turns": len(turns),
        "owners": len({t.session_owner for t in turns}),
        "span_s": max(t.end_s for t in turns) - min(t.arrival_s for t in turns),
        "failed": sum(1 for t in turns if not t.ok),
        "busy_s": sum(t.duration_s for t in turns),
    }
