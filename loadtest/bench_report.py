"""Rows of benchmark figures -> one markdown table (used by ``make bench`` and the replay report).

    >>> print(markdown_table([{"case": "warm", "p50_ms": 1.234}, {"case": "wake", "p50_ms": 41.5}]))
    | case | p50_ms |
    |---|---:|
    | warm | 1.23 |
    | wake | 41.5 |

Columns are the union of the rows' keys in first-seen order (or ``columns=``); numbers are
right-aligned and printed with 3 significant digits (integers as is); missing cells are empty.

CLI: ``python -m loadtest.bench_report rows.json [--title T] [--out table.md]`` where rows.json is
a JSON list of objects (or ``{"rows": [...]}``); prints the table and optionally writes it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path


def format_cell(value: object) -> str:
    """One cell: None -> "", bool -> yes/no, int as is, float with 3 significant digits."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.3g}"
    text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def markdown_table(rows: Sequence[Mapping[str, object]], columns: Sequence[str] | None = None) -> str:
    """Render ``rows`` as a GitHub markdown table (no trailing newline). Empty rows -> ""."""
    if not rows:
        return ""
    if columns is None:
        seen: dict[str, None] = {}
        for row in rows:
            for k in row:
                seen.setdefault(k, None)
        columns = list(seen)
    numeric = {
        c: all(_is_number(r.get(c)) or r.get(c) is None for r in rows) and any(_is_number(r.get(c)) for r in rows)
        for c in columns
    }
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---:" if numeric[c] else "---" for c in columns) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(format_cell(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def write_table(
    rows: Sequence[Mapping[str, object]],
    path: str | Path | None = None,
    *,
    title: str | None = None,
    columns: Sequence[str] | None = None,
    echo: bool = True,
) -> str:
    """Render the table (with an optional ``## title``), print it if ``echo``, write it to ``path``."""
    text = markdown_table(rows, columns)
    if title:
        text = f"## {title}\n\n{text}"
    if echo:
        print(text)
    if path is not None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text + "\n", encoding="utf-8")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench_report", description=__doc__.split("\n")[0])
    ap.add_argument("rows", help="JSON file: a list of objects, or {'rows': [...]}; '-' reads stdin")
    ap.add_argument("--title", default=None)
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = ap.parse_args(argv)
    raw = sys.stdin.read() if args.rows == "-" else Path(args.rows).read_text(encoding="utf-8")
    data = json.loads(raw)
    rows = data["rows"] if isinstance(data, dict) else data
    write_table(rows, args.out, title=args.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
