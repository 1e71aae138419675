"""Logging set-up shared by every process."""

from __future__ import annotations

import logging
import os

from tierq.settings import get_settings


def setup(level: str | None = None) -> None:
    """Log at `level`, else at Settings.log_level (LOG_LEVEL)."""
    # Logs go to stderr, vLLM's too (its default is stdout): a command's stdout is its
    # output — a benchmark's JSON line stays the last line there.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    logging.basicConfig(
        level=(level or get_settings().log_level).upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
