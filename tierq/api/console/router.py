"""`/console`: the operator console, a server-rendered page with a little JavaScript.

The page holds no data: it asks for the admin key (kept in the tab's sessionStorage) and
polls `GET /admin/overview` with it, so a tenant's key, or none, sees nothing but the
admin API's own refusal. Its actions are the admin API's routes (suspend, resume, set a
quota, cancel a batch). Every asset is served from here, and the page's
Content-Security-Policy lets it load nothing from anywhere else.
"""

from __future__ import annotations

import html
from pathlib import Path
from string import Template

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse

from tierq import __version__
from tierq.api.errors import not_found
from tierq.core.tiers import TIER_ORDER

STATIC = Path(__file__).parent / "static"
_FILES = {"console.js": "text/javascript", "console.css": "text/css"}
POLL_MS = 1500
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

router = APIRouter(include_in_schema=False)


@router.get("/console")
async def console(request: Request) -> HTMLResponse:
    root = html.escape(str(request.scope.get("root_path", "")), quote=True)
    page = Template((STATIC / "console.html").read_text()).substitute(
        root=root,
        version=html.escape(__version__),
        poll_ms=POLL_MS,
        tiers=html.escape(",".join(t.value for t in TIER_ORDER), quote=True),
    )
    headers = {
        "Content-Security-Policy": CSP,
        "Cache-Control": "no-store",
        "Referrer-Policy": "no-referrer",
        "X-Content-Type-Options": "nosniff",
    }
    return HTMLResponse(page, headers=headers)


@router.get("/console/static/{name}")
async def asset(name: str) -> FileResponse:
    media_type = _FILES.get(name)
    if media_type is None:
        raise not_found("file", name)
    return FileResponse(STATIC / name, media_type=media_type, headers={"Cache-Control": "no-cache"})
