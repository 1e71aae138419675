"""Options the client commands share (`tierq batch ...`, `tierq admin ...`, benchmarks)."""

from __future__ import annotations

import typer

from tierq.core.settings import get_settings

URL_OPTION = typer.Option(None, "--url", help="The platform (default: TIERQ_URL).")
KEY_OPTION = typer.Option(
    None, help="API key (default: TIERQ_API_KEY, else STATE_DIR/dev-api-key)."
)


def platform_url(given: str | None) -> str:
    """--url, else TIERQ_URL (Settings.tierq_url, http://127.0.0.1:8000 unset)."""
    return given or get_settings().tierq_url
