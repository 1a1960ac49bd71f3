"""What a short piece of user text shown in a table or a log line may hold (label values, API key names).

One rule for every such field: valid Unicode (no lone surrogate, which JSON and a command line's undecodable
bytes allow but UTF-8 cannot hold), no control character (Unicode category Cc: tab, newline, escape ...), no
line or paragraph separator (Zl, Zp) and no bidi control (Unicode's Bidi_Control property, PropList.txt: the
embedding, override and isolate controls of "Trojan Source", CVE-2021-42574, and the directional marks),
which reorder or break how the text around them is displayed, and no invisible character (``INVISIBLE``:
zero width space and its kin), which makes two different values look the same.
"""

from __future__ import annotations

import unicodedata

#: every character of Unicode's Bidi_Control property (a fresh-user run: U+200F was accepted while U+202E
#: was refused)
BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
#: format characters that show as nothing and join or shape nothing: a value holding one looks the same
#: as one without it ("team=prod" and "team=pro\u200bd"; fresh-user tester 35). Soft hyphen, Mongolian
#: vowel separator, zero width space, word joiner and the invisible operators, zero width no-break space
#: (BOM), the Hangul fillers (tester 38). Zero width (non-)joiners U+200C/U+200D and the tag characters stay:
#: Persian, Indic scripts and emoji sequences need them, but a text made of format characters alone
#: (Unicode Cf: a lone joiner) shows as nothing and is refused (``unprintable``)
INVISIBLE = frozenset("\u00ad\u115f\u1160\u180e\u200b\u2060\u2061\u2062\u2063\u2064\u3164\ufeff\uffa0")


def unprintable(s: str) -> str | None:
    """The first character of ``s`` that such text may not hold, as ``U+XXXX``, or None (a lone surrogate
    counts as one)."""
    for ch in s:
        if ch in BIDI_CONTROLS or ch in INVISIBLE or unicodedata.category(ch) in ("Cc", "Zl", "Zp", "Cs"):
            return f"U+{ord(ch):04X}"
    if s and all(unicodedata.category(ch) == "Cf" for ch in s):  # a lone joiner, tag characters only
        return f"U+{ord(s[0]):04X}"
    return None


def text_ok(s: str) -> bool:
    """Valid Unicode text (no lone surrogate such as ``"\\ud800"``, which JSON allows but UTF-8 cannot hold)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
