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
INVISIBLE = frozenset("\u00ad\u115f\u1160\u17b4\u17b5\u180e\u200b\u2060\u2061\u2062\u2063\u2064\u3164"
                      "\ufeff\uffa0")
#: categories of characters that show as nothing on their own: format characters (a lone joiner), marks
#: that combine with a base (U+034F combining grapheme joiner, the variation selectors) and spaces; with
#: U+2800 (braille pattern blank, a "symbol" that looks like a space) a text made of them alone looks
#: empty (fresh-user tester 50: labels of U+034F, U+180B, U+FE0F, U+2800 or U+3000 alone were taken)
_BLANK_CATEGORIES = frozenset(("Cf", "Mn", "Me", "Zs"))
_BLANK_SYMBOLS = frozenset("\u2800")
#: tag characters (U+E0020-U+E007F) are text only in an emoji tag sequence: a black flag U+1F3F4, tag
#: letters, then U+E007F cancel tag (subdivision flags such as England's); anywhere else they hide text
#: that no one sees ("ok" followed by the tags of "hi": fresh-user tester 50)
_TAG_BASE, _TAG_END = "\U0001f3f4", "\U000e007f"


def _is_tag(ch: str) -> bool:
    return "\U000e0020" <= ch <= "\U000e007f"


def _stray_tag(s: str) -> int | None:
    """The index of the first tag character of ``s`` outside an emoji tag sequence, or None."""
    i = 0
    while i < len(s):
        if not _is_tag(s[i]):
            i += 1
            continue
        start = i
        while i < len(s) and _is_tag(s[i]) and s[i] != _TAG_END:
            i += 1
        ended = i < len(s) and s[i] == _TAG_END
        if start == 0 or s[start - 1] != _TAG_BASE or not ended or i == start:
            return start
        i += 1  # past the cancel tag
    return None


def unprintable(s: str) -> str | None:
    """The first character of ``s`` that such text may not hold, as ``U+XXXX``, or None (a lone surrogate
    counts as one). Also refused: tag characters outside an emoji tag sequence, and a text that shows as
    nothing (format characters, combining marks, spaces and U+2800 alone; the empty text is fine)."""
    for ch in s:
        if ch in BIDI_CONTROLS or ch in INVISIBLE or unicodedata.category(ch) in ("Cc", "Zl", "Zp", "Cs"):
            return f"U+{ord(ch):04X}"
    if (at := _stray_tag(s)) is not None:
        return f"U+{ord(s[at]):04X}"
    if s and all(ch in _BLANK_SYMBOLS or unicodedata.category(ch) in _BLANK_CATEGORIES for ch in s):
        return f"U+{ord(s[0]):04X}"
    return None


def text_ok(s: str) -> bool:
    """Valid Unicode text (no lone surrogate such as ``"\\ud800"``, which JSON allows but UTF-8 cannot hold)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
