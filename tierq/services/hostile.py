"""What no request may carry, wherever it sits: values PostgreSQL cannot store or the
platform cannot honour. One check serves the API (every JSON body, query string and path)
and batch lines, so that nothing refused online is accepted in a batch, or the reverse.

- NUL characters (PostgreSQL's text refuses them) and lone UTF-16 surrogates (they cannot
  be encoded as UTF-8), in any string, key or value;
- integers outside a signed 64-bit range (no column or engine parameter takes them);
- nesting deeper than MAX_DEPTH (a parser's recursion is no place to find out).
"""

from __future__ import annotations

import re
from typing import Any

MAX_DEPTH = 32
INT_MIN, INT_MAX = -(2**63), 2**63 - 1

# A raw JSON body that matches none of these cannot hold anything `unstorable` refuses, so
# the common request is judged without parsing it twice: a NUL escape, a surrogate escape
# that is not half of a pair, a run of 19 or more digits, or many opening brackets — and
# any NUL byte, which UTF-8 JSON never holds but UTF-16 and UTF-32 JSON (which json.loads
# reads too, and those patterns do not see) always do.
_SUSPECT = re.compile(
    rb"\x00"  # a NUL byte: JSON in UTF-16 or UTF-32
    rb"|\\u0000"  # NUL
    rb"|\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"  # a high surrogate alone
    rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"  # a low one alone
    rb"|\d{19,}"
)
_BRACKETS_SUSPECT = MAX_DEPTH


def _bad_string(s: str) -> str | None:
    if "\x00" in s:
        return "contains a NUL character"
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone surrogate"
    return None


def unstorable(value: Any) -> str | None:
    """Why `value` (parsed JSON, or a str) cannot be taken, naming where; None if it can."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"{path or 'the body'} is nested deeper than {MAX_DEPTH} levels"
        if isinstance(item, str):
            why = _bad_string(item)
            if why:
                return f"{path or 'a value'} {why}"
        elif isinstance(item, bool) or item is None or isinstance(item, float):
            continue
        elif isinstance(item, int):
            if not INT_MIN <= item <= INT_MAX:
                return f"{path or 'a value'} is an integer outside the 64-bit range"
        elif isinstance(item, dict):
            for key, sub in item.items():
                why = _bad_string(str(key))
                if why:
                    return f"a key in {path or 'the body'} {why}"
                stack.append((sub, f"{path}.{key}" if path else str(key), depth + 1))
        elif isinstance(item, list):
            stack.extend((sub, f"{path}[{i}]", depth + 1) for i, sub in enumerate(item))
    return None


def suspect(raw: bytes) -> bool:
    """Whether a raw JSON body could hold something `unstorable` refuses (cheap)."""
    if _SUSPECT.search(raw):
        return True
    return raw.count(b"[") + raw.count(b"{") > _BRACKETS_SUSPECT
