"""The native job API's response bodies (see tierq/api/schemas.py for how they are used): the
job object and its list."""

from __future__ import annotations

from typing import Literal

from tierq.api.schemas import Body, Page, TokenLogprob, Usage


class JobChoice(Body):
    index: int
    text: str
    finish_reason: str | None


class JobResult(Body):
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # with `logprobs` asked for
    choices: list[JobChoice] | None = None  # with n > 1


class JobError(Body):
    code: str
    message: str | None


class Job(Body):
    id: str
    object: Literal["job"]
    status: str
    tier: str
    model: str
    created_at: int
    started_at: int | None
    finished_at: int | None
    result: JobResult | None
    usage: Usage | None
    error: JobError | None
    metadata: dict[str, str] | None


class JobList(Page):
    data: list[Job]
