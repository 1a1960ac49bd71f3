"""A session's label limits (at most 64 labels, keys of 1-63 characters, values of at most 256) were
checked but stated nowhere: the OpenAPI document states them now, and they are the limits the API
checks (a fresh-user finding)."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from api.app import CreateSession, create_app
from substrate.settings import Settings


@pytest.fixture(scope="module")
def labels_schema() -> dict:
    spec = create_app(Settings()).openapi()
    return spec["components"]["schemas"]["CreateSession"]["properties"]["labels"]


def _ok(labels: dict[str, str]) -> bool:
    try:
        CreateSession(actorTemplate="counter", labels=labels)
    except ValidationError:
        return False
    return True


def test_the_openapi_document_states_the_label_limits(labels_schema: dict) -> None:
    assert labels_schema["type"] == "object" and labels_schema["maxProperties"] == 64
    assert labels_schema["additionalProperties"] == {"type": "string", "maxLength": 256}
    names = labels_schema["propertyNames"]
    assert (names["minLength"], names["maxLength"]) == (1, 63)
    desc = labels_schema["description"]
    assert "64 labels" in desc and "1-63" in desc and "256 characters" in desc


def test_the_stated_limits_are_the_checked_ones(labels_schema: dict) -> None:
    assert _ok({f"k{i}": "v" for i in range(64)}) and not _ok({f"k{i}": "v" for i in range(65)})
    assert _ok({"k": "v" * 256}) and not _ok({"k": "v" * 257})
    key = re.compile(labels_schema["propertyNames"]["pattern"])
    for k in ["a", "A9", "team", "app.kubernetes.io/name", "a-b_c", "k" * 63, "k" * 64, "", "-a", "a-", "a b", "é"]:
        stated = key.fullmatch(k) is not None and 1 <= len(k) <= 63
        assert stated == _ok({k: "v"}), k


@pytest.mark.parametrize("value,ok", [
    ("plain text, with spaces", True), ("Привет 世界 👨‍👩‍👧", True), ("فارسی\u200c", True),  # ZWJ/ZWNJ are text
    ("evil\u202eexe.txt", False), ("a\u2066b", False), ("line\u2028break", False), ("para\u2029", False),
    ("rlm\u200fmark", False), ("lrm\u200e", False), ("alm\u061c", False),  # the directional marks too
    ("tab\there", False), ("new\nline", False), ("esc\x1b[31m", False), ("del\x7f", False),
    # invisible: "pro\u200bd" reads as "prod" (fresh-user tester 35)
    ("pro\u200bd", False), ("\ufeffprod", False), ("pr\u2060od", False), ("soft\u00adhyphen", False),
    # tester 38: a Hangul filler, and text of format characters alone (a lone joiner, tag characters)
    ("a\u3164b", False), ("\u200d", False), ("\u200c\u200d", False), ("\U000e0041\U000e0042", False),
    ("a\u200db", True),
    # tester 50: tags hiding text after a visible one, and values that look empty (a combining grapheme
    # joiner, a Mongolian variation selector, a Khmer inherent vowel, VS16, braille blank, ideographic or
    # plain spaces alone); an emoji tag sequence (England's flag), VS16 after a heart and accents stay
    ("ok\U000e0068\U000e0069", False), ("\u034f", False), ("\u180b", False), ("a\u17b4b", False),
    ("\ufe0f", False), ("\u2800", False), ("\u3000", False), (" ", False), ("\U0001f3f4\U000e0067", False),
    ("\U0001f3f4\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f", True), ("\u2764\ufe0f", True),
    ("e\u0301", True), ("", True),
])
def test_label_values_refuse_what_changes_how_text_is_shown(value: str, ok: bool) -> None:
    """A fresh-user run set U+202E (right-to-left override) and U+2028 as label values; the CLI's table
    printed them as such."""
    assert _ok({"k": value}) is ok, value
    if not ok:
        with pytest.raises(ValidationError) as e:
            CreateSession(actorTemplate="counter", labels={"k": value})
        assert "U+" in str(e.value)


def test_null_labels_and_env_mean_none() -> None:
    """``"labels": null`` / ``"env": null`` were 422 "Input should be a valid dictionary" while ``"id": null``
    was accepted (a fresh-user finding): null means none for each; a non-object stays refused."""
    body = CreateSession.model_validate({"actorTemplate": "counter", "id": None, "labels": None, "env": None})
    assert (body.id, body.labels, body.env) == (None, {}, {})
    for field in ("labels", "env"):
        with pytest.raises(ValidationError, match="valid dictionary"):
            CreateSession.model_validate({"actorTemplate": "counter", field: 5})


@pytest.mark.parametrize("worker", ["", "w" * 254])
def test_a_resume_pinned_to_no_worker_name_is_invalid_input(worker: str) -> None:
    """Fresh-user tester 50: ``{"worker": ""}`` was 422 ``unknown_worker`` "unknown worker ''": no worker
    can have that name, so it is the body that is wrong (``invalid_input``), checked before any lookup."""
    from api.app import ResumeSession

    with pytest.raises(ValidationError):
        ResumeSession.model_validate({"worker": worker})
    assert ResumeSession.model_validate({"worker": "w-1"}).worker == "w-1"
