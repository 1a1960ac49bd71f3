"""The shipped counter agent (``workers.agents.counter``): its answers and errors."""

from __future__ import annotations

import pytest

from workers.agents.counter import Counter
from workers.handler import AgentError


async def test_counts_and_restores():
    c = Counter(None)  # type: ignore[arg-type]  # the counter never reads its context
    await c.start({"count": 4})
    assert await c.invoke("increment") == {"count": 5}
    assert await c.invoke({"op": "get"}) == {"count": 5}


async def test_an_unknown_input_is_echoed_clipped_not_whole():
    """Fresh-user run: a 900 KB input came back whole in the agent_error message (921,680 bytes)."""
    c = Counter(None)  # type: ignore[arg-type]  # the counter never reads its context
    await c.start(None)
    with pytest.raises(AgentError) as e:
        await c.invoke("x" * 900_000)
    assert len(str(e.value)) < 200 and "900002 characters" in str(e.value)
    with pytest.raises(AgentError, match="unknown input 'incr'"):  # a short one is shown as it is
        await c.invoke("incr")
