"""Reading batch input files (tierq/services/batch_input.py): validation and resumable reads."""

from __future__ import annotations

import json
from pathlib import Path

from tierq.core.file_store import LocalStore
from tierq.services.batch_input import read_requests, validate_file

CHAT = "/v1/chat/completions"


def _line(custom_id: str, **over: object) -> bytes:
    item = {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": {"model": "m"}, **over}
    return json.dumps(item).encode() + b"\n"


def test_validation_reports_each_problem_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(
        _line("a") + b"\n" + b"oops\n" + _line("a") + _line("b", url="/v1/embeddings") + _line("c")
    )
    result = validate_file(LocalStore(tmp_path), path.name, CHAT, max_requests=10, max_errors=10)
    assert result.requests == 5  # the blank line is not a request
    assert [(e["code"], e["line"]) for e in result.errors] == [
        ("invalid_json_line", 3),
        ("duplicate_custom_id", 4),
        ("invalid_url", 5),
    ]
    capped = validate_file(LocalStore(tmp_path), path.name, CHAT, max_requests=2, max_errors=1)
    assert len(capped.errors) == 1 and capped.errors_total == 4  # too_many_requests too


def test_reading_requests_resumes_from_a_byte_offset(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(_line(f"r{i}") for i in range(5)) + b"\n\n")
    first, offset, line = read_requests(LocalStore(tmp_path), path.name, 0, 0, 2, CHAT)
    assert [r.custom_id for r in first] == ["r0", "r1"] and line == 2
    rest, end, last = read_requests(LocalStore(tmp_path), path.name, offset, line, 100, CHAT)
    assert [r.custom_id for r in rest] == ["r2", "r3", "r4"] and [r.number for r in rest] == [
        3,
        4,
        5,
    ]
    assert end == path.stat().st_size and last == 7  # trailing blank lines consumed
    assert read_requests(LocalStore(tmp_path), path.name, end, last, 100, CHAT) == ([], end, last)


def test_an_integer_too_long_for_python_fails_its_line_not_the_validation(
    tmp_path: Path,
) -> None:
    # json.loads raises a plain ValueError for an integer of over 4,300 digits: validation
    # must name the line (the batch fails), not raise and leave the batch retrying forever.
    path = tmp_path / "in.jsonl"
    huge = b'{"custom_id": "big", "method": "POST", "url": "%s", "body": {"max_tokens": %s}}\n'
    path.write_bytes(_line("a") + huge % (CHAT.encode(), b"9" * 5000) + _line("b"))
    result = validate_file(LocalStore(tmp_path), path.name, CHAT, max_requests=10, max_errors=10)
    assert result.requests == 3
    assert [(e["code"], e["line"]) for e in result.errors] == [("invalid_request", 2)]
