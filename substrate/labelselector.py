"""Kubernetes-style label selectors over a session's labels (``GET /v1/sessions?labelSelector=``).

The forms of https://kubernetes.io/docs/concepts/overview/working-with-objects/labels/#label-selectors,
requirements joined by commas (AND):

    key=value   key==value   has the label with that value
    key!=value                 has not the label with that value (a session without the label matches)
    key                        has the label (any value)
    !key                       has not the label
    key in (v1,v2)             has the label with one of the values
    key notin (v1,v2)          has not the label with one of the values (a session without it matches)

A key follows the rule labels are made with (``LABEL_KEY_PATTERN``: 1-63 letters, digits, ``-``, ``_``,
``.`` or ``/``, starting and ending with a letter or digit); a value is at most ``MAX_VALUE_CHARS``
characters without whitespace, ``,``, ``(``, ``)``, ``=`` or ``!`` (labels with such values cannot be
selected by value), and may be empty (``key=`` selects the label set to ""). Spaces around keys, operators
and values are ignored. An empty (or blank) selector selects every session, as in Kubernetes.

``equality_selector`` writes the selector of a label mapping (``key=value`` requirements).

``parse_selector`` raises ``SelectorError`` (a ``ValueError``) with a message saying which requirement is
wrong and how; the API answers it 422 ``invalid_input`` naming ``query.labelSelector``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from substrate.errors import clip

#: a label's key, as ``POST /v1/sessions`` takes it (the API's ``CreateSession`` checks labels with it)
LABEL_KEY_PATTERN = r"[A-Za-z0-9]([-A-Za-z0-9_./]{0,61}[A-Za-z0-9])?"
_KEY = re.compile(rf"\A{LABEL_KEY_PATTERN}\Z")
#: a label value's length limit, as ``POST /v1/sessions`` takes it
MAX_VALUE_CHARS = 256
#: a selector's length limit (a few hundred requirements; what a query string carries comfortably)
MAX_SELECTOR_CHARS = 4096

_SPECIAL = "=!(),"
_WORD = r"[^\s=!(),]+"
_EXISTS = re.compile(rf"\A(!?)\s*({_WORD})\Z")
_COMPARE = re.compile(rf"\A({_WORD})\s*(==|=|!=)\s*(.*)\Z", re.S)
_SET = re.compile(rf"\A({_WORD})\s+(in|notin)\s*\((.*)\)\Z", re.S)
FORMS = "key=value, key==value, key!=value, key, !key, key in (v1,v2), key notin (v1,v2)"


class SelectorError(ValueError):
    """A selector that is none of the forms (see the module docstring); the message says what is wrong."""


@dataclass(frozen=True)
class Requirement:
    """One requirement: ``op`` one of ``=``, ``!=``, ``in``, ``notin``, ``exists``, ``!exists``."""

    key: str
    op: str
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        has = self.key in labels
        if self.op == "exists":
            return has
        if self.op == "!exists":
            return not has
        hit = has and labels[self.key] in self.values
        return hit if self.op in ("=", "in") else not hit


@dataclass(frozen=True)
class Selector:
    """Requirements that must all hold (none: every label set matches)."""

    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)


def _split(text: str) -> list[str]:
    """``text`` cut at the commas outside parentheses; raises ``SelectorError`` for unbalanced ones."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
            if depth > 1:
                raise SelectorError(f"a '(' inside another at character {i + 1}: a value list is not nested")
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError(f"a ')' without its '(' at character {i + 1}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise SelectorError("a '(' is never closed")
    parts.append(text[start:])
    return parts


def selectable(value: str) -> bool:
    """Whether a selector can name ``value`` (a label's value) in a ``key=value`` requirement: no
    whitespace and none of ``=!(),`` (a label may hold them; such a label is selected by its key only)."""
    return not any(ch.isspace() or ch in _SPECIAL for ch in value)


def _key(key: str, n: int) -> str:
    if not _KEY.fullmatch(key):
        raise SelectorError(f"requirement {n}: {clip(key)} is no label key (1-63 letters, digits, '-', '_', '.' "
                            "or '/', starting and ending with a letter or digit)")
    return key


def _value(value: str, n: int) -> str:
    value = value.strip()
    if len(value) > MAX_VALUE_CHARS:
        raise SelectorError(f"requirement {n}: a value is over {MAX_VALUE_CHARS} characters, which no label's is")
    if any(ch.isspace() or ch in _SPECIAL for ch in value):
        raise SelectorError(f"requirement {n}: the value {clip(value)} has whitespace or one of {_SPECIAL!r} in it")
    return value


def _requirement(text: str, n: int) -> Requirement:
    text = text.strip()
    if not text:
        raise SelectorError(f"requirement {n} is empty (a comma too many?)")
    if m := _EXISTS.fullmatch(text):
        return Requirement(_key(m[2], n), "!exists" if m[1] else "exists")
    if m := _SET.fullmatch(text):
        if not m[3].strip():
            raise SelectorError(f"requirement {n}: {m[2]} takes at least one value: {m[1]} {m[2]} (v1,v2)")
        return Requirement(_key(m[1], n), m[2], frozenset(_value(v, n) for v in m[3].split(",")))
    if m := _COMPARE.fullmatch(text):
        return Requirement(_key(m[1], n), "!=" if m[2] == "!=" else "=", frozenset([_value(m[3], n)]))
    if text.startswith("!"):
        raise SelectorError(f"requirement {n} ({clip(text)}): '!' goes before a bare key only (!key); "
                            "for a value, key!=value")
    if re.match(rf"{_WORD}\s+(in|notin)\b", text):
        raise SelectorError(f"requirement {n} ({clip(text)}): in and notin take values in parentheses: "
                            "key in (v1,v2)")
    raise SelectorError(f"requirement {n} ({clip(text)}) is none of the forms {FORMS}")


def equality_selector(labels: Mapping[str, str]) -> str:
    """The selector text requiring each of ``labels`` with its value (``{"team": "a", "env": "prod"}`` ->
    ``"env=prod,team=a"``, keys sorted; none: ``""``, every session). Raises ``SelectorError`` naming the key
    whose key is no label key or whose value no selector can state (whitespace, one of ``=!(),``, over
    ``MAX_VALUE_CHARS``), and ``TypeError`` for a key or value that is not a str."""
    parts = []
    for key in sorted(labels, key=str):
        value = labels[key]
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"label selector: key {key!r} and its value must be str, got "
                            f"{type(key).__name__}: {type(value).__name__}")
        if not _KEY.fullmatch(key):
            raise SelectorError(f"label selector: {clip(key)} is no label key (1-63 letters, digits, '-', '_', "
                                "'.' or '/', starting and ending with a letter or digit)")
        if len(value) > MAX_VALUE_CHARS:
            raise SelectorError(f"label selector: the value of {clip(key)} is over {MAX_VALUE_CHARS} characters, "
                                "which no label's is")
        # a value is taken as it is: a selector strips the spaces around one, so they cannot be stated either
        if any(ch.isspace() or ch in _SPECIAL for ch in value):
            raise SelectorError(f"label selector: the value of {clip(key)} ({clip(value)}) has whitespace or one "
                                f"of {_SPECIAL!r} in it: a selector cannot state it")
        parts.append(f"{key}={value}")
    return ",".join(parts)


def parse_selector(text: str) -> Selector:
    """The ``Selector`` written as ``text`` (see the module docstring); raises ``SelectorError``."""
    if len(text) > MAX_SELECTOR_CHARS:
        raise SelectorError(f"over {MAX_SELECTOR_CHARS} characters ({len(text)})")
    if not text.strip():
        return Selector()
    return Selector(tuple(_requirement(part, n) for n, part in enumerate(_split(text), 1)))
