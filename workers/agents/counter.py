"""The counter agent: its count must survive everything (suspend, resume, worker crash, move).

Input ``"increment"`` adds one and answers ``{"count": N}``; ``"get"`` answers the count. A dict
``{"op": "increment"|"get", "work_s": 0.2, "burn": false}`` does the same after sleeping (or burning
CPU, ``burn: true``) ``work_s`` seconds, which the load tests use to model a turn's run time; ``{}`` is
an increment. Any other field, a ``burn`` that is not a boolean, a ``work_s`` that is not a number
(``null`` included), or another input is the caller's error (422 ``agent_error``).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from workers.handler import Agent, AgentError

#: the fields an input object may have
_FIELDS = frozenset({"op", "work_s", "burn"})
#: what the agent takes, for its error messages
_FORMS = '"increment", "get" or {"op": "increment"|"get", "work_s": seconds, "burn": true|false}'


def _shown(value: Any, limit: int = 80) -> str:
    """``value`` as JSON, at most about ``limit`` characters (an error echoes a bounded copy of the input:
    a fresh-user run got 900 KB back)."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= limit else f"{text[:limit - 20]}... ({len(text)} characters)"


class Counter(Agent):
    count = 0

    async def start(self, state: dict[str, Any] | None) -> None:
        self.count = int((state or {}).get("count", 0))

    async def invoke(self, input: Any) -> Any:  # noqa: A002
        op, work_s, burn = input, 0.0, False
        field = ""  # where op came from, for the message
        if isinstance(input, dict):
            extra = sorted(str(k) for k in input if k not in _FIELDS)
            if extra:  # {"input": "get"} pasted as the CLI's INPUT counted one up (a fresh-user run)
                raise AgentError(f"unknown field(s) {', '.join(_shown(k, 40) for k in extra[:5])} in the input "
                                 f"object: use {_FORMS}")
            op, field = input.get("op", "increment"), "op "
            raw = input.get("work_s", 0)
            # a bad input is the caller's error (422 agent_error), not a crash of the agent (500):
            # float("abc") and float([1]) raised, and a fresh-user run got 500 agent_crashed
            if isinstance(raw, bool) or not isinstance(raw, (int, float)):
                raise AgentError(f"work_s must be a number of seconds, got {_shown(raw)}")
            work_s = float(raw)
            if not 0 <= work_s <= 3600:
                raise AgentError("work_s must be between 0 and 3600")
            burn = input.get("burn", False)
            if not isinstance(burn, bool):  # "yes" and 1 were taken as true (a fresh-user run)
                raise AgentError(f"burn must be true or false, got {_shown(burn)}")
        if op not in ("increment", "get"):
            raise AgentError(f"unknown {field or 'input '}{_shown(op)}: use {_FORMS}")
        if work_s:
            if burn:
                end = time.perf_counter() + work_s
                while time.perf_counter() < end:
                    pass
            else:
                await asyncio.sleep(work_s)
        if op == "increment":
            self.count += 1
        return {"count": self.count}

    async def snapshot(self) -> dict[str, Any]:
        return {"count": self.count}
