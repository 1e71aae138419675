"""Reading batch input files: validation of the whole file, and lines from a byte offset.

Blocking reads of the file store (callers run them in a thread), one line at a time: a
200 MB file is never held in memory. Line numbers are 1-based physical lines, as OpenAI reports
them; blank lines are skipped and not counted as requests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tierq.core.file_store import FileStore
from tierq.services.hostile import unstorable


@dataclass
class Validation:
    requests: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    errors_total: int = 0

    def add(self, code: str, message: str, line: int | None, limit: int) -> None:
        self.errors_total += 1
        if len(self.errors) < limit:
            self.errors.append({"code": code, "message": message, "param": None, "line": line})


@dataclass(frozen=True)
class RawLine:
    number: int  # 1-based physical line
    custom_id: str
    body: dict[str, Any]


def _lines(
    store: FileStore, name: str, offset: int = 0, start_line: int = 0
) -> Iterator[tuple[int, int, bytes]]:
    """(line number, offset after the line, bytes) from `offset` on."""
    with store.open(name, offset) as f:
        number = start_line
        position = offset
        for raw in f:
            number += 1
            position += len(raw)
            yield number, position, raw


def check_line(raw: bytes, endpoint: str) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
    """The parsed line, or the (code, message) of what is wrong with it."""
    try:
        item = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return None, ("invalid_json_line", "This line is not parseable as valid JSON.")
    except ValueError:  # valid JSON that Python refuses: an integer of over 4,300 digits
        return None, ("invalid_request", "The line holds an integer too large to be taken.")
    if not isinstance(item, dict):
        return None, ("invalid_json_line", "Each line must be a JSON object.")
    why = unstorable(item)
    if why is not None:  # as the API refuses it online (PostgreSQL could not store it)
        return None, ("invalid_request", f"The line cannot be taken: {why}.")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, ("missing_custom_id", "The line has no 'custom_id' string.")
    if len(custom_id) > 512:
        return None, ("invalid_custom_id", "'custom_id' is longer than 512 characters.")
    if item.get("method") != "POST":
        return None, ("invalid_method", "The 'method' of every line must be 'POST'.")
    if item.get("url") != endpoint:
        return None, (
            "invalid_url",
            f"The 'url' of every line must be the batch's endpoint '{endpoint}'.",
        )
    if not isinstance(item.get("body"), dict):
        return None, ("invalid_body", "The line's 'body' must be a JSON object.")
    return item, None


def validate_file(
    store: FileStore, name: str, endpoint: str, *, max_requests: int, max_errors: int
) -> Validation:
    """Every structural problem of the file, by line (OpenAI's `errors` of a failed batch)."""
    result = Validation()
    seen: set[str] = set()
    for number, _, raw in _lines(store, name):
        if not raw.strip():
            continue
        result.requests += 1
        if result.requests == max_requests + 1:
            result.add(
                "too_many_requests",
                f"The file has more than {max_requests} requests, the most a batch may hold.",
                number,
                max_errors,
            )
        item, problem = check_line(raw, endpoint)
        if problem is not None:
            result.add(problem[0], problem[1], number, max_errors)
            continue
        assert item is not None
        custom_id = item["custom_id"]
        if custom_id in seen:
            result.add(
                "duplicate_custom_id",
                f"The custom_id '{custom_id[:100]}' appears more than once.",
                number,
                max_errors,
            )
        seen.add(custom_id)
    if result.requests == 0 and not result.errors:
        result.add("empty_file", "The input file has no requests.", None, max_errors)
    return result


def requests_from(
    store: FileStore, name: str, offset: int, start_line: int, endpoint: str
) -> Iterator[tuple[RawLine, int]]:
    """Each request from `offset` on (one read of the file) and the offset after it.

    The file was validated, so every non-blank line parses.
    """
    for number, position, raw in _lines(store, name, offset, start_line):
        if raw.strip():
            yield _request(number, raw, endpoint), position


def read_requests(
    store: FileStore, name: str, offset: int, start_line: int, count: int, endpoint: str
) -> tuple[list[RawLine], int, int]:
    """Up to `count` requests from `offset`; returns them, the new offset and line number
    (past blank lines before the next request, or to the end)."""
    out: list[RawLine] = []
    position, number = offset, start_line
    for number_, position_, raw in _lines(store, name, offset, start_line):
        if len(out) >= count:
            break
        number, position = number_, position_
        if raw.strip():
            out.append(_request(number_, raw, endpoint))
    return out, position, number


def _request(number: int, raw: bytes, endpoint: str) -> RawLine:
    """A line of a validated file, whose every non-blank line parses."""
    item, problem = check_line(raw, endpoint)
    if item is None:
        raise ValueError(f"line {number} of a validated file is invalid: {problem}")
    return RawLine(number, item["custom_id"], item["body"])
