"""Label selectors (``substrate.labelselector``): the Kubernetes forms parse and match as Kubernetes
defines them, and anything else is a ``SelectorError`` saying which requirement is wrong and how."""

from __future__ import annotations

import re

import pytest

from api.app import CreateSession
from substrate.labelselector import LABEL_KEY_PATTERN, MAX_SELECTOR_CHARS, SelectorError, parse_selector

A = {"team": "a", "env": "prod", "tier": "web"}
B = {"team": "b", "env": ""}
C: dict[str, str] = {}


@pytest.mark.parametrize("text,a,b,c", [
    ("team=a", True, False, False),
    ("team==a", True, False, False),
    (" team = a ", True, False, False),
    ("team!=a", False, True, True),  # without the label: matches, as in Kubernetes
    ("team", True, True, False),
    ("!team", False, False, True),
    ("! team", False, False, True),
    ("env=", False, True, False),  # an empty value is a value
    ("team=a,env=prod", True, False, False),
    ("team,!tier", False, True, False),
    ("team in (a,b)", True, True, False),
    ("team in ( a , c )", True, False, False),
    ("team notin (a)", False, True, True),
    ("tier in (web),team notin (b)", True, False, False),
    ("team=a,team=b", False, False, False),
    ("", True, True, True),  # empty: every session, as in Kubernetes
    ("   ", True, True, True),
    ("app.kubernetes.io/name", False, False, False),
    ("in", False, False, False),  # "in" alone is a key
])
def test_the_forms_match_as_kubernetes_defines_them(text: str, a: bool, b: bool, c: bool) -> None:
    s = parse_selector(text)
    assert (s.matches(A), s.matches(B), s.matches(C)) == (a, b, c)


@pytest.mark.parametrize("text,says", [
    ("a=b,", "requirement 2 is empty"),
    (",a", "requirement 1 is empty"),
    ("a=b,,c", "requirement 2 is empty"),
    ("a=b=c", "requirement 1: the value 'b=c'"),
    ("a=b c", "whitespace"),
    ("!a=b", "'!' goes before a bare key only"),
    ("a in b", "in and notin take values in parentheses"),
    ("a notin b,c", "in and notin take values in parentheses"),
    ("a in ()", "in takes at least one value"),
    ("a in (b", "'(' is never closed"),
    ("a)", "')' without its '('"),
    ("a in ((b))", "inside another"),
    ("-a=b", "'-a' is no label key"),
    ("a-=b", "'a-' is no label key"),
    ("k" * 64, "is no label key"),
    ("a<3", "is no label key"),
    ("te am=a", "is none of the forms"),
    ("a=" + "v" * 257, "over 256 characters"),
    ("a=" * (MAX_SELECTOR_CHARS // 2 + 1), f"over {MAX_SELECTOR_CHARS} characters"),
])
def test_anything_else_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(SelectorError) as e:
        parse_selector(text)
    assert says in str(e.value), str(e.value)


def test_a_selector_key_is_a_label_key_and_the_api_takes_labels_by_the_same_rule() -> None:
    for key in ["a", "A9", "team", "app.kubernetes.io/name", "a-b_c", "k" * 63]:
        CreateSession(actorTemplate="counter", labels={key: "v"})
        assert parse_selector(key).matches({key: "v"})
    assert re.fullmatch(LABEL_KEY_PATTERN, "k" * 63) and not re.fullmatch(LABEL_KEY_PATTERN, "k" * 64)
    parse_selector("a=" + "v" * 256)  # the longest label value
