"""A small client of the platform's Files and Batches API: `tierq batch submit|download`
and `tierq bench batch` use it. Plain httpx; uploads and downloads are streamed."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tierq.client.http import error_message
from tierq.core.settings import Settings

TERMINAL = ("completed", "failed", "expired", "cancelled")
DEFAULT_URL = "http://127.0.0.1:8000"


def resolve_key(key: str | None, settings: Settings) -> str:
    """--key, else TIERQ_API_KEY, else the embedded default's dev key file."""
    if key:
        return key
    if settings.tierq_api_key:
        return settings.tierq_api_key
    if settings.dev_key_file.exists():
        return settings.dev_key_file.read_text().strip()
    raise SystemExit("no API key: pass --key, set TIERQ_API_KEY, or run `make run` here first")


class BatchClient:
    def __init__(self, url: str, key: str, timeout: float = 60) -> None:
        self.http = httpx.Client(
            base_url=url.rstrip("/"),
            headers={"Authorization": f"Bearer {key}"},
            timeout=timeout,
        )

    def close(self) -> None:
        self.http.close()

    def _ok(self, resp: httpx.Response) -> dict[str, Any]:
        if resp.status_code >= 400:
            message = error_message(resp)
            raise RuntimeError(f"{resp.request.method} {resp.request.url.path}: {message}")
        body: dict[str, Any] = resp.json()
        return body

    def upload(self, path: Path) -> dict[str, Any]:
        with path.open("rb") as f:
            resp = self.http.post(
                "/v1/files",
                files={"file": (path.name, f, "application/jsonl")},
                data={"purpose": "batch"},
                timeout=None,
            )
        return self._ok(resp)

    def create(
        self, file_id: str, endpoint: str, metadata: dict[str, str] | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input_file_id": file_id,
            "endpoint": endpoint,
            "completion_window": "24h",
        }
        if metadata:
            body["metadata"] = metadata
        return self._ok(self.http.post("/v1/batches", json=body))

    def get(self, batch_id: str) -> dict[str, Any]:
        return self._ok(self.http.get(f"/v1/batches/{batch_id}"))

    def wait(
        self,
        batch_id: str,
        on_update: Callable[[dict[str, Any]], None] | None = None,
        poll_s: float = 0.5,
    ) -> dict[str, Any]:
        while True:
            batch = self.get(batch_id)
            if on_update is not None:
                on_update(batch)
            if batch["status"] in TERMINAL:
                return batch
            time.sleep(poll_s)

    def download(self, file_id: str, target: Path) -> int:
        """Stream a file's content to `target`; returns its size."""
        size = 0
        with (
            self.http.stream("GET", f"/v1/files/{file_id}/content", timeout=None) as resp,
            target.open("wb") as out,
        ):
            if resp.status_code >= 400:
                resp.read()
                self._ok(resp)
            for chunk in resp.iter_bytes():
                out.write(chunk)
                size += len(chunk)
        return size
