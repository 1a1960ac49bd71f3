"""The counter agent: its count must survive everything (suspend, resume, worker crash, move).

Input ``"increment"`` adds one and answers ``{"count": N}``; ``"get"`` answers the count. A dict
``{"op": "increment"|"get", "work_s": 0.2, "burn": false}`` does the same after sleeping (or burning
CPU, ``burn: true``) ``work_s`` seconds, which the load tests use to model a turn's run time. Any other
field of such an object, or another input, is the caller's error (422 ``agent_error``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from workers.handler import Agent, AgentError

#: the fields an input object may have
_FIELDS = frozenset({"op", "work_s", "burn"})


class Counter(Agent):
    count = 0

    async def start(self, state: dict[str, Any] | None) -> None:
        self.count = int((state or {}).get("count", 0))

    async def invoke(self, input: Any) -> Any:  # noqa: A002
        op, work_s, burn = input, 0.0, False
        if isinstance(input, dict):
            extra = sorted(str(k) for k in input if k not in _FIELDS)
            if extra:  # {"input": "get"} pasted as the CLI's INPUT counted one up (a fresh-user run)
                shown = ", ".join(repr(k[:40]) for k in extra[:5])
                raise AgentError(f"unknown field(s) {shown} in the input object: use 'increment', 'get' or "
                                 '{"op": "increment"|"get", "work_s": seconds, "burn": true|false}')
            op = input.get("op", "increment")
            raw = input.get("work_s", 0) or 0
            # a bad input is the caller's error (422 agent_error), not a crash of the agent (500):
            # float("abc") and float([1]) raised, and a fresh-user run got 500 agent_crashed
            if isinstance(raw, bool) or not isinstance(raw, (int, float)):
                raise AgentError(f"work_s must be a number of seconds, got {type(raw).__name__}")
            work_s = float(raw)
            burn = bool(input.get("burn", False))
            if not 0 <= work_s <= 3600:
                raise AgentError("work_s must be between 0 and 3600")
        if work_s:
            if burn:
                end = time.perf_counter() + work_s
                while time.perf_counter() < end:
                    pass
            else:
                await asyncio.sleep(work_s)
        if op == "increment":
            self.count += 1
        elif op != "get":
            shown = repr(op)
            if len(shown) > 80:  # an error echoes a bounded copy of the input (fresh-user: 900 KB came back)
                shown = f"{shown[:60]}... ({len(shown)} characters)"
            raise AgentError(f"unknown input {shown}: use 'increment', 'get' or "
                             '{"op": "increment"|"get", "work_s": seconds, "burn": true|false}')
        return {"count": self.count}

    async def snapshot(self) -> dict[str, Any]:
        return {"count": self.count}
