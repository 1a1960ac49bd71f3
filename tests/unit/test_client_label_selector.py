"""``list_sessions(label_selector=...)`` takes a mapping of labels and a list of requirements besides the
selector's text: ``{"team": "a"}`` was sent as its repr (``"{'team': 'a'}"``, a 422) by a fresh-user
tester. What no selector can state raises before anything is sent."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from substrate.client import SubstrateClient
from substrate.labelselector import parse_selector


def _sent(selector: Any) -> str | None:
    seen: list[httpx.Request] = []

    def h(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        return httpx.Response(200, json={"items": [], "metadata": {"continue": None}})

    c = SubstrateClient("http://fake.example", transport=httpx.MockTransport(h))
    c.list_sessions(label_selector=selector)
    list(c.iter_sessions(label_selector=selector))
    got = {r.url.params.get("labelSelector") for r in seen}
    assert len(got) == 1, got
    return got.pop()


@pytest.mark.parametrize("selector,sent", [
    ({"team": "a"}, "team=a"),
    ({"team": "a", "env": "prod", "app.io/tier": "web"}, "app.io/tier=web,env=prod,team=a"),  # keys sorted
    ({"team": ""}, "team="),  # the label set to ""
    ({}, ""),  # every session, as an empty selector
    (["team=a", "env!=prod"], "team=a,env!=prod"),
    (("tier in (web,api)", "!gpu"), "tier in (web,api),!gpu"),
    ("team=a,env!=prod", "team=a,env!=prod"),
    (None, None),
])
def test_a_mapping_or_a_list_is_sent_as_the_selectors_text(selector: Any, sent: str | None) -> None:
    assert _sent(selector) == sent
    if sent:
        parse_selector(sent)  # what the API parses


def test_a_mapping_selects_what_its_labels_are() -> None:
    labels = {"team": "a", "env": "prod"}
    text = _sent(labels)
    assert text is not None
    sel = parse_selector(text)
    assert sel.matches(labels) and sel.matches({**labels, "x": "y"}) and not sel.matches({"team": "a"})


@pytest.mark.parametrize("value", ["a b", "a,b", "a(b", "a)", "a=b", "!a", " a", "a\n", "x" * 257])
def test_a_value_no_selector_can_state_is_a_value_error_naming_its_key(value: str) -> None:
    with pytest.raises(ValueError) as e:
        _sent({"ok": "1", "team": value})
    assert "'team'" in str(e.value) and "'ok'" not in str(e.value)


@pytest.mark.parametrize("key", ["", "a b", "-a", "a=b", "x" * 64])
def test_a_key_that_is_no_label_key_is_a_value_error_naming_it(key: str) -> None:
    with pytest.raises(ValueError) as e:
        _sent({key: "v"})
    assert repr(key)[:60] in str(e.value) and "no label key" in str(e.value)


@pytest.mark.parametrize("selector", [{"team": 1}, {1: "a"}, ["team=a", 1], {"team=a"}, 3])
def test_another_type_is_a_type_error(selector: Any) -> None:
    with pytest.raises(TypeError):
        _sent(selector)
