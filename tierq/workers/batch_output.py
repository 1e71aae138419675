"""A batch's output and error files, in OpenAI's line format and in input order: a line per
succeeded job in the output file, a line per failed one (and per request an expired batch
never reached) in the error file; a job cancelled with its batch writes neither. Each is
written to the file store under a new file id, and appears there once complete.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Protocol

from tierq.core.file_store import FileStore, Writer
from tierq.core.states import JobStatus
from tierq.models.records import BatchRecord, JobRecord
from tierq.services import openai_compat
from tierq.services.batch_input import requests_from

HELD_LINES = 1000  # lines of an expired batch's unexpanded requests held before a write


class LineSink(Protocol):
    def write(self, line: str, /) -> object: ...


class Lines:
    """A file's lines, held in memory until `flush` (blocking) writes them to the store."""

    def __init__(self, writer: Writer) -> None:
        self.writer = writer
        self._held: list[str] = []

    def write(self, line: str) -> None:
        self._held.append(line)

    def flush(self) -> None:
        data = "".join(self._held).encode()
        self._held.clear()
        if data:
            self.writer.write(data)
        self.writer.touch()


def dump(line: dict[str, Any]) -> str:
    return json.dumps(line, separators=(",", ":"), ensure_ascii=False) + "\n"


def write_results(
    jobs: Iterable[JobRecord], endpoint: str, out: LineSink, err: LineSink
) -> tuple[int, int]:
    """Output lines for succeeded jobs, error lines for failed and expired ones; returns
    (completed, failed)."""
    chat = endpoint == openai_compat.CHAT_ENDPOINT
    completed = failed = 0
    for job in jobs:
        request_id = "batch_req_" + job.id.removeprefix("job_")
        if job.status == JobStatus.SUCCEEDED:
            completed += 1
            response = {
                "status_code": 200,
                "request_id": job.id,
                "body": openai_compat.completion_body(job, chat),
            }
            out.write(
                dump(
                    {
                        "id": request_id,
                        "custom_id": job.custom_id,
                        "response": response,
                        "error": None,
                    }
                )
            )
        elif job.status == JobStatus.FAILED or job.error_code == "batch_expired":
            failed += 1
            code = job.error_code or "server_error"
            message = job.error_message or "The request failed."
            response = None
            if job.status == JobStatus.FAILED:
                status = openai_compat.failure_status(job)
                response = {
                    "status_code": status,
                    "request_id": job.id,
                    "body": {
                        "error": {
                            "message": message,
                            "type": "invalid_request_error" if status < 500 else "server_error",
                            "code": code,
                            "param": None,
                        }
                    },
                }
            err.write(
                dump(
                    {
                        "id": request_id,
                        "custom_id": job.custom_id,
                        "response": response,
                        "error": {"code": code, "message": message},
                    }
                )
            )
        # cancelled with the batch: neither output nor error (OpenAI keeps only results)
    return completed, failed


def write_unexpanded(store: FileStore, batch: BatchRecord, err: Lines) -> int:
    """Error lines for the requests an expired batch never got to (past its cursor);
    blocking (in a thread), written as they are read."""
    if not store.exists(batch.input_file_id):
        return 0
    written = 0
    requests = requests_from(
        store, batch.input_file_id, batch.next_offset, batch.next_line, batch.endpoint
    )
    for item, _ in requests:
        written += 1
        err.write(
            dump(
                {
                    "id": f"batch_req_{batch.id.removeprefix('batch_')}_{item.number}",
                    "custom_id": item.custom_id,
                    "response": None,
                    "error": {
                        "code": "batch_expired",
                        "message": "The batch expired before this request was run.",
                    },
                }
            )
        )
        if written % HELD_LINES == 0:
            err.flush()
    err.flush()
    return written


def keep(lines: Lines, name: str, filename: str) -> tuple[str, str, int] | None:
    """Commit a written file under `name`: (id, filename, bytes); None (and nothing kept)
    if empty. Kept whatever the tenant's storage quota and file count: an output is never
    lost, and it counts against both from its row on (models.files.add_file). Blocking."""
    lines.flush()
    if lines.writer.size == 0:
        lines.writer.abort()
        return None
    lines.writer.commit()
    return name, filename, lines.writer.size
