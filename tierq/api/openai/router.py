"""OpenAI's online endpoints, routed: models, chat completions and completions. The
requests are tierq/services/openai_compat.py's, the answers tierq/api/openai/protocol.py's, and
serving them is tierq/api/openai/serving.py's."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tierq.api.deps import PartsDep, TenantDep, api_key_id
from tierq.api.errors import APIError, documented
from tierq.api.jobs.events import EVENT_STREAM
from tierq.api.openai.protocol import ChatCompletion, Model, ModelList, TextCompletion
from tierq.api.openai.serving import OpenAIServing
from tierq.api.schemas import answered
from tierq.services import openai_compat as oa

# Every route: the door's guard (400), the key (401), the database or the queue (503).
router = APIRouter(prefix="/v1", tags=["openai"], responses=documented(400, 401, 503))


def _completion(model: type[ChatCompletion | TextCompletion]) -> dict[int | str, dict[str, Any]]:
    """A completion's answers: JSON, or chunks as Server-Sent Events with `stream: true`.
    A job that failed is answered with its error: 400 (the request's fault), 409
    (cancelled) or 500."""
    return {
        200: {"model": model, "content": EVENT_STREAM},
        **documented(403, 404, 409, 413, 429),
    }


async def get_serving(request: Request) -> OpenAIServing:
    serving: OpenAIServing = request.app.state.openai
    return serving


ServingDep = Annotated[OpenAIServing, Depends(get_serving)]


@router.get("/models", response_model=None, responses=answered(ModelList))
async def list_models(_: TenantDep, parts: PartsDep) -> dict[str, Any]:
    return {"object": "list", "data": [_model(parts.settings.served_model_name)]}


@router.get(
    "/models/{model_id:path}",
    response_model=None,
    responses=answered(Model, 404),
)
async def get_model(model_id: str, _: TenantDep, parts: PartsDep) -> dict[str, Any]:
    if model_id != parts.settings.served_model_name:
        raise APIError(
            404, f"The model '{model_id}' does not exist.", "model_not_found", param="model"
        )
    return _model(model_id)


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "tierq"}


@router.post("/chat/completions", response_model=None, responses=_completion(ChatCompletion))
async def chat_completions(
    body: oa.ChatCompletionRequest, request: Request, tenant: TenantDep, serving: ServingDep
) -> JSONResponse | StreamingResponse:
    return await serving.complete(request, tenant, api_key_id(request), body)


@router.post("/completions", response_model=None, responses=_completion(TextCompletion))
async def completions(
    body: oa.CompletionRequest, request: Request, tenant: TenantDep, serving: ServingDep
) -> JSONResponse | StreamingResponse:
    return await serving.complete(request, tenant, api_key_id(request), body)
