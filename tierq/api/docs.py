"""`/docs` and `/redoc` with every asset served by tierq itself: Swagger UI 5 and ReDoc as
the `fastapi-offline` package ships them (FastAPI's own pages load them from a CDN, so on
an air-gapped cluster the API's documentation would be blank)."""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import FileResponse, HTMLResponse

from tierq.api.errors import not_found

ASSETS = Path(fastapi_offline.__file__).parent / "static"
ASSETS_URL = "/static/docs"
# The files the pages use; nothing else in the package's folder is served.
_FILES = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "redoc.standalone.js": "text/javascript",
    "favicon.png": "image/png",
}
OAUTH2_REDIRECT_URL = "/docs/oauth2-redirect"

router = APIRouter(include_in_schema=False)


def _root(request: Request) -> str:
    return str(request.scope.get("root_path", ""))


@router.get("/docs")
async def swagger_ui(request: Request) -> HTMLResponse:
    root = _root(request)
    return get_swagger_ui_html(
        openapi_url=f"{root}{request.app.openapi_url}",
        title=f"{request.app.title} - Swagger UI",
        oauth2_redirect_url=f"{root}{OAUTH2_REDIRECT_URL}",
        swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
        swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
    )


@router.get(OAUTH2_REDIRECT_URL)
async def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    root = _root(request)
    return get_redoc_html(
        openapi_url=f"{root}{request.app.openapi_url}",
        title=f"{request.app.title} - ReDoc",
        redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js",
        redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
        with_google_fonts=False,
    )


@router.get(ASSETS_URL + "/{name}")
async def asset(name: str) -> FileResponse:
    media_type = _FILES.get(name)
    if media_type is None:
        raise not_found("file", name)
    return FileResponse(
        ASSETS / name, media_type=media_type, headers={"Cache-Control": "max-age=86400"}
    )
