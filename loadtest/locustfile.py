"""Locust load test for the agent session runtime's REST API (works against any ``--host``).

    uv run locust -f loadtest/locustfile.py --host http://127.0.0.1:8080 --headless -u 50 -r 10 -t 5m
    uv run locust -f loadtest/locustfile.py --host ... --headless -u 20 -r 5 -t 2m CounterUser NotebookUser
    SUBSTRATE_LOAD_SHAPE=burst uv run locust -f loadtest/locustfile.py --host ... --headless -t 5m

User classes (pick some by name on the command line; default: all, by weight):

- ``SeedAgentUser`` (weight 6): the seed workload of an agent session. Each turn is a prompt that
  runs ~10 s, then the user idles ~20 min (both +/-25 % jitter, both divided by
  ``SUBSTRATE_TIME_COMPRESSION``, default 60: 10 s -> ~0.17 s of work, 20 min -> ~20 s idle). Every
  turn checks the counter is exactly +1 and that ``GET /v1/sessions/{id}`` shows a live lifecycle
  state. The request after an idle is named ``invoke (after idle)``: it usually wakes the session.
- ``CounterUser`` (weight 2): increments and reads a counter session, sometimes suspends it
  explicitly; any count other than the expected one is a failure ("lost state").
- ``NotebookUser`` (weight 1): a ``notebook`` session keeps ``counter`` and ``history`` variables
  across turns and suspensions; a reset value or a missing variable (NameError) is a failure.
- ``ChurnUser`` (weight 1): create -> invoke -> delete -> GET (must be gone), over and over.

Each user creates its own sessions with unique ids ``lt-<uuid4 hex>`` and deletes them when it
stops. A create answered ``503 no_capacity`` is retried after ``Retry-After`` (<= 5 s, 5 tries).
Failures are reported with ``response.failure(...)`` so they appear in Locust's statistics.

``BurstShape`` (active only with ``SUBSTRATE_LOAD_SHAPE=burst``): ``SUBSTRATE_BURST_BASE_USERS``
(default 5) users, rising to ``SUBSTRATE_BURST_PEAK_USERS`` (default 50) for the last
``SUBSTRATE_BURST_LEN_S`` (default 15) seconds of every ``SUBSTRATE_BURST_PERIOD_S`` (default 60),
spawning at ``SUBSTRATE_BURST_SPAWN_RATE`` (default 25/s). Locust does not apply ``-t`` to shapes
in headless mode, so the shape itself stops at ``-t`` (if given) or after
``SUBSTRATE_SHAPE_DURATION_S`` (default 300 s).

Other settings (env): ``SUBSTRATE_TOKEN`` (bearer token), ``SUBSTRATE_COUNTER_TEMPLATE``
(default ``counter``), ``SUBSTRATE_NOTEBOOK_TEMPLATE`` (default ``notebook``).
"""

from __future__ import annotations

import functools
import math
import os
import random
import time
import uuid
from typing import Any

from locust import FastHttpUser, LoadTestShape, between, task
from locust.exception import StopUser

TIME_COMPRESSION = max(1e-9, float(os.environ.get("SUBSTRATE_TIME_COMPRESSION", "60")))
COUNTER_TEMPLATE = os.environ.get("SUBSTRATE_COUNTER_TEMPLATE", "counter")
NOTEBOOK_TEMPLATE = os.environ.get("SUBSTRATE_NOTEBOOK_TEMPLATE", "notebook")
LIVE_STATES = frozenset({"PENDING", "STARTING", "RUNNING", "SUSPENDING", "SUSPENDED", "RESUMING"})
SEED_RUN_S = 10.0  # a prompt's run time before compression
SEED_IDLE_S = 20 * 60.0  # idle between prompts before compression
CREATE_TRIES = 5


def _jitter(seconds: float) -> float:
    return seconds * random.uniform(0.75, 1.25)


def _retry_after(value: str | None) -> float:
    try:
        return min(5.0, max(0.0, float(value))) if value else 1.0
    except ValueError:
        return 1.0


def _json(resp) -> dict | None:
    try:
        data = resp.json()
    except Exception:  # noqa: BLE001 - a non-JSON body is reported by the caller
        return None
    return data if isinstance(data, dict) else None


def _needs_session(fn: Any) -> Any:
    """A task of a user whose session could not be created (``self.sid`` None) stops the user quietly:
    a ``StopUser`` raised in ``on_start`` is logged by Locust as an error with a traceback, one per user,
    on top of the failed create it already counts (fresh-user round 10, a dead host)."""
    @functools.wraps(fn)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "sid", None) is None:
            raise StopUser()
        return fn(self, *args, **kwargs)
    return run


class SubstrateUser(FastHttpUser):
    """Shared plumbing: session create/delete, invoke helpers, expected-count bookkeeping."""

    abstract = True
    network_timeout = 60.0
    connection_timeout = 10.0

    def on_start(self) -> None:
        self.sessions: list[str] = []
        token = os.environ.get("SUBSTRATE_TOKEN")
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}

    def on_stop(self) -> None:
        for sid in list(getattr(self, "sessions", [])):
            self.delete_session(sid)

    # -- sessions
    def create_session(self, template: str) -> str | None:
        """POST /v1/sessions with a unique id; retries 503 no_capacity; -> id or None."""
        sid = f"lt-{uuid.uuid4().hex}"
        body = {"actorTemplate": template, "id": sid, "labels": {"loadtest": type(self).__name__}}
        # listed for on_stop's delete before it is asked for: a user stopped mid-create, or a create that
        # timed out here but succeeded there, left sessions behind (a fresh-user run: 2 after 60 s)
        self.sessions.append(sid)
        for attempt in range(CREATE_TRIES):
            with self.client.post("/v1/sessions", json=body, headers=self.auth, catch_response=True,
                                  name=f"/v1/sessions [create {template}]") as r:
                if r.status_code == 503 and attempt < CREATE_TRIES - 1:
                    r.success()  # a retried 503 is back-pressure, not a failure
                    wait = _retry_after(r.headers.get("Retry-After"))
                elif r.status_code in (200, 201):
                    data = _json(r) or {}
                    if data.get("id") not in (None, sid):
                        r.failure(f"created id {data.get('id')!r}, asked for {sid!r}")
                    return sid
                else:
                    r.failure(f"create {template}: HTTP {r.status_code} {r.text[:200] if r.text else ''}")
                    if 400 <= r.status_code < 500:  # refused: nothing was made
                        self.sessions.remove(sid)
                    return None
            time.sleep(wait)
        return None

    def delete_session(self, sid: str) -> bool:
        with self.client.delete(f"/v1/sessions/{sid}", headers=self.auth, catch_response=True,
                                name="/v1/sessions/[id] [delete]") as r:
            if r.status_code in (200, 202, 204, 404):
                r.success()
                ok = r.status_code != 404
            else:
                r.failure(f"delete: HTTP {r.status_code}")
                ok = False
        if sid in self.sessions:
            self.sessions.remove(sid)
        return ok

    def check_state(self, sid: str) -> str | None:
        """GET /v1/sessions/{id}: must answer a live lifecycle state (FAILED is a failure)."""
        with self.client.get(f"/v1/sessions/{sid}", headers=self.auth, catch_response=True,
                             name="/v1/sessions/[id]") as r:
            data = _json(r) if r.status_code == 200 else None
            if data is None:
                r.failure(f"get session: HTTP {r.status_code}")
                return None
            state = data.get("state")
            if state not in LIVE_STATES:
                r.failure(f"session {sid} in state {state!r}")
            return state

    def suspend(self, sid: str) -> bool:
        with self.client.post(f"/v1/sessions/{sid}/suspend", headers=self.auth, catch_response=True,
                              name="/v1/sessions/[id]/suspend") as r:
            if r.status_code in (200, 202):
                return True
            if r.status_code == 409:  # already suspending/suspended: fine
                r.success()
                return True
            r.failure(f"suspend: HTTP {r.status_code}")
            return False


class CounterState:
    """Expected counter value: after an unanswered increment the next count may be +1 or +2 ..."""

    def __init__(self) -> None:
        self.count = 0
        self.uncertain = 0

    def expected(self) -> tuple[int, int]:
        return self.count + 1, self.count + 1 + self.uncertain

    def check_increment(self, r, label: str) -> None:
        """Validate an invoke(increment) response inside ``catch_response``."""
        if r.status_code != 200:
            self.uncertain += 1
            r.failure(f"{label}: HTTP {r.status_code}")
            return
        output = (_json(r) or {}).get("output")
        count = output.get("count") if isinstance(output, dict) else None
        lo, hi = self.expected()
        if not isinstance(count, int):
            self.uncertain += 1
            r.failure(f"{label}: no count in {str(output)[:120]!r}")
            return
        if not lo <= count <= hi:
            r.failure(f"lost state: count {count}, expected {lo}" + (f"..{hi}" if hi != lo else ""))
        self.count, self.uncertain = count, 0

    def check_get(self, r, label: str) -> None:
        if r.status_code != 200:
            r.failure(f"{label}: HTTP {r.status_code}")
            return
        output = (_json(r) or {}).get("output")
        count = output.get("count") if isinstance(output, dict) else None
        if not isinstance(count, int) or not self.count <= count <= self.count + self.uncertain:
            r.failure(f"lost state: get answered {count!r}, expected {self.count}")
            return
        self.count, self.uncertain = count, 0


class SeedAgentUser(SubstrateUser):
    """Prompt, run ~10 s, idle ~20 min (time-compressed); verifies state each turn."""

    weight = 6

    def wait_time(self) -> float:
        return _jitter(SEED_IDLE_S) / TIME_COMPRESSION

    def on_start(self) -> None:
        super().on_start()
        self.sid = self.create_session(COUNTER_TEMPLATE)
        if self.sid is None:
            return  # its tasks stop it (``_needs_session``)
        self.counter = CounterState()
        self.turns = 0

    @task
    @_needs_session
    def prompt(self) -> None:
        work_s = _jitter(SEED_RUN_S) / TIME_COMPRESSION
        name = "/v1/sessions/[id]/invoke (after idle)" if self.turns else "/v1/sessions/[id]/invoke (first)"
        with self.client.post(f"/v1/sessions/{self.sid}/invoke", headers=self.auth, catch_response=True,
                              json={"input": {"op": "increment", "work_s": round(work_s, 4)}}, name=name) as r:
            self.counter.check_increment(r, "seed turn")
        self.turns += 1
        self.check_state(self.sid)


class CounterUser(SubstrateUser):
    """Counter session: increment / get / suspend; the count must never go back or skip."""

    weight = 2
    wait_time = between(0.5, 3.0)

    def on_start(self) -> None:
        super().on_start()
        self.sid = self.create_session(COUNTER_TEMPLATE)
        if self.sid is None:
            return  # its tasks stop it (``_needs_session``)
        self.counter = CounterState()
        self.after_suspend = False

    def _name(self, op: str) -> str:
        return f"/v1/sessions/[id]/invoke {op}" + (" (after suspend)" if self.after_suspend else "")

    @task(10)
    @_needs_session
    def increment(self) -> None:
        with self.client.post(f"/v1/sessions/{self.sid}/invoke", json={"input": "increment"}, headers=self.auth,
                              catch_response=True, name=self._name("increment")) as r:
            self.counter.check_increment(r, "increment")
        self.after_suspend = False

    @task(3)
    @_needs_session
    def get(self) -> None:
        with self.client.post(f"/v1/sessions/{self.sid}/invoke", json={"input": "get"}, headers=self.auth,
                              catch_response=True, name=self._name("get")) as r:
            self.counter.check_get(r, "get")
        self.after_suspend = False

    @task(1)
    @_needs_session
    def suspend_then_wake(self) -> None:
        if self.suspend(self.sid):
            self.after_suspend = True


class NotebookUser(SubstrateUser):
    """Notebook session: ``counter`` and ``history`` must survive every turn and suspension."""

    weight = 1
    wait_time = between(0.5, 3.0)

    def on_start(self) -> None:
        super().on_start()
        self.sid = self.create_session(NOTEBOOK_TEMPLATE)
        if self.sid is None:
            return  # its tasks stop it (``_needs_session``)
        self.n = 0  # last value of `counter` the session acknowledged
        self.uncertain = 0
        self.after_suspend = False

    @task(10)
    @_needs_session
    def step(self) -> None:
        code = ("counter = 1\nhistory = [1]\ncounter" if self.n == 0 and self.uncertain == 0
                else "counter += 1\nhistory.append(counter)\ncounter")
        lo, hi = self.n + 1, self.n + 1 + self.uncertain
        name = "/v1/sessions/[id]/invoke notebook" + (" (after suspend)" if self.after_suspend else "")
        with self.client.post(f"/v1/sessions/{self.sid}/invoke", json={"input": code}, headers=self.auth,
                              catch_response=True, name=name) as r:
            self.after_suspend = False
            if r.status_code != 200:
                self.uncertain += 1
                r.failure(f"notebook: HTTP {r.status_code}")
                return
            output = (_json(r) or {}).get("output") or {}
            text = f"{output.get('stdout', '')} {output.get('stderr', '')} {output.get('error', '')}"
            value = output.get("repr") if isinstance(output, dict) else None
            try:
                got = int(str(value).strip())
            except ValueError:
                got = None
            if "NameError" in text or got is None:
                r.failure(f"notebook variable missing: repr={value!r} {text.strip()[:160]!r}")
                self.n, self.uncertain = 0, 0  # start over so one loss is reported once
                return
            if not lo <= got <= hi:
                r.failure(f"lost state: notebook counter {got}, expected {lo}" + (f"..{hi}" if hi != lo else ""))
            self.n, self.uncertain = got, 0

    @task(2)
    @_needs_session
    def check_history(self) -> None:
        if self.n == 0 or self.uncertain:
            return
        with self.client.post(f"/v1/sessions/{self.sid}/invoke", json={"input": "len(history) == counter"},
                              headers=self.auth, catch_response=True, name="/v1/sessions/[id]/invoke notebook check") as r:
            output = (_json(r) or {}).get("output") if r.status_code == 200 else None
            if not isinstance(output, dict) or str(output.get("repr")).strip() != "True":
                r.failure(f"notebook history lost: {str(output)[:160]!r} (HTTP {r.status_code})")

    @task(1)
    @_needs_session
    def suspend_then_wake(self) -> None:
        if self.suspend(self.sid):
            self.after_suspend = True


class ChurnUser(SubstrateUser):
    """Create -> invoke -> delete -> GET (gone), repeatedly."""

    weight = 1
    wait_time = between(0.2, 1.0)

    @task
    def churn(self) -> None:
        sid = self.create_session(COUNTER_TEMPLATE)
        if sid is None:
            return
        counter = CounterState()
        with self.client.post(f"/v1/sessions/{sid}/invoke", json={"input": "increment"}, headers=self.auth,
                              catch_response=True, name="/v1/sessions/[id]/invoke (churn)") as r:
            counter.check_increment(r, "churn increment")
        self.delete_session(sid)
        with self.client.get(f"/v1/sessions/{sid}", headers=self.auth, catch_response=True,
                             name="/v1/sessions/[id] (after delete)") as r:
            state = (_json(r) or {}).get("state") if r.status_code == 200 else None
            if r.status_code == 404 or state == "DELETED":
                r.success()
            else:
                r.failure(f"deleted session still answers HTTP {r.status_code} state {state!r}")


def _env_float(name: str, default: float) -> float:
    """``name``'s value as a finite number >= 0, or ``default`` when unset. Exits with one line for
    anything else (a bad value was silently replaced by the default: fresh-user round 10)."""
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise SystemExit(f"locustfile: {name}={text!r} is not a number >= 0")
    return value


_SHAPE = os.environ.get("SUBSTRATE_LOAD_SHAPE", "").strip().lower()
if _SHAPE not in ("", "burst"):  # ignored without a word before (fresh-user round 10)
    raise SystemExit(f"locustfile: SUBSTRATE_LOAD_SHAPE={_SHAPE!r}: the one shape is 'burst' (or unset: Locust's "
                     "own --users/--spawn-rate)")


class BurstShape(LoadTestShape):
    """Base load with a periodic burst; see the module docstring for the knobs."""

    abstract = _SHAPE != "burst"

    base_users = int(_env_float("SUBSTRATE_BURST_BASE_USERS", 5))
    peak_users = int(_env_float("SUBSTRATE_BURST_PEAK_USERS", 50))
    period_s = max(1.0, _env_float("SUBSTRATE_BURST_PERIOD_S", 60))
    burst_len_s = _env_float("SUBSTRATE_BURST_LEN_S", 15)
    spawn_rate = _env_float("SUBSTRATE_BURST_SPAWN_RATE", 25)
    default_duration_s = _env_float("SUBSTRATE_SHAPE_DURATION_S", 300)

    def duration_s(self) -> float:
        opts = getattr(getattr(self.runner, "environment", None), "parsed_options", None)
        run_time = getattr(opts, "run_time", None)
        return float(run_time) if run_time else self.default_duration_s

    def users_at(self, t_s: float) -> int:
        """Target user count ``t_s`` seconds into the test."""
        return self.peak_users if (t_s % self.period_s) >= self.period_s - self.burst_len_s else self.base_users

    def tick(self):
        t = self.get_run_time()
        if t >= self.duration_s():
            return None
        return self.users_at(t), self.spawn_rate
