"""Logging set-up shared by every process."""

from __future__ import annotations

import logging
import os


def setup(level: str | None = None) -> None:
    logging.basicConfig(
        level=(level or os.environ.get("LOG_LEVEL", "INFO")).upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
