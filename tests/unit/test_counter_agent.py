"""The example counter agent: a bad ``work_s`` is the caller's error (``AgentError``, 422 ``agent_error``),
not an exception the worker reports as a crash (a fresh-user run: ``"work_s": "abc"`` gave 500
``agent_crashed``)."""

from __future__ import annotations

import pytest

from pathlib import Path

from workers.agents.counter import Counter
from workers.handler import AgentError, SessionContext


def _counter(tmp_path: Path) -> Counter:
    return Counter(SessionContext(session_id="s1", epoch=1, template="counter", workspace=tmp_path))


@pytest.mark.parametrize("work_s", ["abc", [1], {"s": 1}, True, -1, 3601])
async def test_a_bad_work_s_is_an_agent_error_and_counts_nothing(work_s: object, tmp_path: Path) -> None:
    c = _counter(tmp_path)
    await c.start({"count": 3})
    with pytest.raises(AgentError, match="work_s"):
        await c.invoke({"op": "increment", "work_s": work_s})
    assert await c.invoke("get") == {"count": 3}


async def test_a_good_work_s_still_counts(tmp_path: Path) -> None:
    c = _counter(tmp_path)
    await c.start(None)
    assert await c.invoke({"op": "increment", "work_s": 0.001}) == {"count": 1}
    assert await c.invoke({"op": "increment", "work_s": 0}) == {"count": 2}


@pytest.mark.parametrize("bad", [{"input": "get"}, {"a": 1}, {"op": "get", "wrok_s": 1}])
async def test_an_input_object_with_an_unknown_field_is_an_agent_error_and_counts_nothing(bad: object,
                                                                                        tmp_path: Path) -> None:
    """A fresh-user run: ``substrate sessions invoke ID '{"input":"get"}'`` (the REST body pasted as the
    CLI's INPUT) counted one up: any object was an increment. Now an unknown field is refused, naming it
    and the forms the agent takes."""
    c = _counter(tmp_path)
    await c.start({"count": 7})
    with pytest.raises(AgentError, match="unknown field.*op.*increment"):
        await c.invoke(bad)
    assert await c.invoke("get") == {"count": 7}
    assert await c.invoke({}) == {"count": 8}, "an empty object is still an increment (op's default)"


@pytest.mark.parametrize("bad,says", [({"op": "get", "burn": "yes"}, 'burn must be true or false, got "yes"'),
                                      ({"burn": 1}, "burn must be true or false, got 1"),
                                      ({"work_s": None}, "work_s must be a number of seconds, got null"),
                                      ({"op": "GET"}, 'unknown op "GET"'),
                                      ({"op": None}, "unknown op null"),
                                      (["get"], 'unknown input ["get"]')])
async def test_each_bad_input_is_named_as_json_and_counts_nothing(bad: object, says: str, tmp_path: Path) -> None:
    """A fresh-user run: ``"burn": "yes"`` and ``1`` were taken as true, ``"work_s": null`` as 0, and the
    messages showed Python values (``None``, ``True``) and called a bad ``op`` an unknown input."""
    c = _counter(tmp_path)
    await c.start({"count": 2})
    with pytest.raises(AgentError) as e:
        await c.invoke(bad)
    assert says in str(e.value), str(e.value)
    assert await c.invoke({"op": "get", "burn": True}) == {"count": 2}
