"""One error model for every handler: OpenAI's `{"error": {"message", "type", "code"}}`."""

from __future__ import annotations

import logging
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from tierq.core.file_store import StoreUnavailable
from tierq.core.redis_conn import is_unavailable as redis_unavailable
from tierq.models.db import is_unavailable as db_unavailable
from tierq.services.requests import Refused

log = logging.getLogger(__name__)

# What a client is told to wait before retrying while the database or Redis is unreachable.
UNAVAILABLE_RETRY_AFTER_S = 2


_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None
    param: str | None


class ErrorBody(BaseModel):
    """OpenAI's error shape: the body of every error the platform answers."""

    error: ErrorDetail


# What each error status means here, for the OpenAPI document.
_DOCUMENTED = {
    400: "Invalid request: a value the schema or the deployment's limits refuse, or one no "
    "request may carry (NUL, a lone surrogate, an integer past 64 bits, nesting past 32).",
    401: "No API key, or one that is wrong or revoked.",
    403: "The key may not do this: a tenant's key on the admin API, a suspended tenant, or "
    "a tier the tenant may not use.",
    404: "No such resource of this tenant, or no such model.",
    409: "A conflict with the resource's state.",
    413: "The request body is larger than the deployment takes, or a file quota is full.",
    415: "The request body is not of the media type this operation takes.",
    429: "A quota, a rate limit or a cap on concurrent work; Retry-After says when to retry.",
    503: "A service the platform depends on is unavailable; Retry-After says when to retry.",
}


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=`: each error status it answers, in OpenAI's error shape."""
    return {status: {"model": ErrorBody, "description": _DOCUMENTED[status]} for status in statuses}


# The HTTP layer's refusals (an unknown path, a bad key...) are the domain's: one type, one
# handler, whichever layer refuses.
APIError = Refused


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    kind = _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


def error_response(
    status: int,
    message: str,
    code: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status, headers=headers)


def not_found(what: str, ident: str) -> APIError:
    return APIError(404, f"No {what} found with id '{ident}'.", f"{what}_not_found")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "json_invalid":
        return "The request body is not valid JSON.", None
    return (f"Invalid value for '{param}': {msg}." if param else f"{msg}."), param


def install(app: FastAPI) -> None:
    @app.exception_handler(Refused)
    async def _refused(_: Request, exc: Refused) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.retry_after_s is not None:
            # 429 and 503 carry Retry-After: the OpenAI SDKs wait that long before retrying.
            headers["Retry-After"] = str(exc.retry_after_s)
        return error_response(exc.status, exc.message, exc.code, exc.param, headers or None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(request)
        return error_response(exc.status_code, str(exc.detail), code, headers=headers)

    async def _dependency(_: Request, exc: Exception) -> JSONResponse:
        if db_unavailable(exc) or redis_unavailable(exc) or isinstance(exc, StoreUnavailable):
            # A restart or a lost connection: the SDKs retry after Retry-After. Nothing was
            # accepted that could not be recorded (admission commits the row first).
            log.warning("dependency unavailable: %s: %s", type(exc).__name__, exc)
            return error_response(
                503,
                "A service the platform depends on is unavailable. Retry after a moment.",
                "service_unavailable",
                headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
            )
        return _internal(exc)

    # Handled here, not by the catch-all below (which Starlette re-raises to the server).
    dependency_errors = (
        sa_exc.DBAPIError,
        sa_exc.TimeoutError,
        redis.RedisError,
        OSError,
        StoreUnavailable,
    )
    for dependency_error in dependency_errors:
        app.add_exception_handler(dependency_error, _dependency)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return _internal(exc)


def _allowed_methods(request: Request) -> str:
    """Every method a route takes at the request's path: Starlette's 405 names only those of
    the first route there (GET /v1/jobs and POST /v1/jobs are two routes)."""
    path = request.scope.get("path", "")
    methods = {
        method
        for route in request.app.router.routes
        if isinstance(route, Route) and route.methods and route.path_regex.fullmatch(path)
        for method in route.methods
    }
    return ", ".join(sorted(methods))


def _internal(exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return error_response(500, "The server had an error processing the request.", "internal_error")
