"""A batch's output and error files, in OpenAI's line format and in input order: a line per
succeeded job in the output file, a line per failed one (and per request an expired batch
never reached) in the error file; a job cancelled with its batch writes neither. The files
are written as `.part` files beside the others and kept under a file id once complete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from models.records import BatchRecord, JobRecord
from services import openai_compat
from services.batch_input import read_requests
from tierq.ids import new_id
from tierq.settings import Settings
from tierq.states import JobStatus

READ_PAGE = 1000  # input lines read at a time


def dump(line: dict[str, Any]) -> str:
    return json.dumps(line, separators=(",", ":"), ensure_ascii=False) + "\n"


def write_results(
    jobs: Iterable[JobRecord], endpoint: str, out: IO[str], err: IO[str]
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


def write_unexpanded(settings: Settings, batch: BatchRecord, err: IO[str]) -> int:
    """Error lines for the requests an expired batch never got to (past its cursor)."""
    source = settings.file_path(batch.input_file_id)
    if not source.exists():
        return 0
    written = 0
    offset, line = batch.next_offset, batch.next_line
    while True:
        raw, offset, line = read_requests(source, offset, line, READ_PAGE, batch.endpoint)
        if not raw:
            return written
        for item in raw:
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


def keep(
    settings: Settings, batch: BatchRecord, tmp: Path, kind: str
) -> tuple[str, str, int] | None:
    """Give a written .part file a file id: (id, filename, bytes); None (and removed) if empty.
    Kept whatever the tenant's storage quota and file count: an output is never lost, and it
    counts against both from its row on (models.files.add_file)."""
    size = tmp.stat().st_size
    if size == 0:
        tmp.unlink(missing_ok=True)
        return None
    file_id = new_id("file")
    tmp.rename(settings.file_path(file_id))
    os.utime(settings.file_path(file_id))  # the orphan sweep counts its age from here
    return file_id, f"{batch.id}_{kind}.jsonl", size
