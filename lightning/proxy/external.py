"""Calls to external providers (OpenAI, Anthropic, any LiteLLM provider) through LiteLLM's Router,
for frozen models and optimisers that are not trained; LiteLLM is imported only when such a model is asked for."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic import BaseModel, Field

from lightning.environment import litellm_offline


class ExternalModel(BaseModel):
    """A model answered by a provider through LiteLLM's Router (spans, but no token ids)."""

    model_name: str
    """The name agents ask for."""
    litellm_params: dict[str, Any] = Field(repr=False)
    """LiteLLM's parameters, e.g. {"model": "openai/gpt-4o-mini", "api_key": "..."}."""


def make_router(models: Sequence[ExternalModel]) -> Any:
    # Without this LiteLLM fetches its model price list from the internet at import.
    litellm_offline()
    import litellm

    litellm.telemetry = False
    model_list = [{"model_name": m.model_name, "litellm_params": dict(m.litellm_params)} for m in models]
    return litellm.Router(model_list=model_list)


async def complete(router: Any, body: dict[str, Any], operation: str) -> tuple[int, Any]:
    """(200, response dict) or (200, async iterator of chunk dicts) when streaming, or
    (status, error in OpenAI's shape)."""
    kwargs = {k: v for k, v in body.items() if k not in ("model", "return_token_ids")}
    try:
        if operation == "chat":
            result = await router.acompletion(model=body["model"], **kwargs)
        else:
            result = await router.atext_completion(model=body["model"], **kwargs)
    except Exception as exc:  # LiteLLM maps provider errors to its own exception types
        status = getattr(exc, "status_code", None)
        status = status if isinstance(status, int) and 400 <= status < 600 else 502
        error = {"message": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__, "param": None, "code": status}
        return status, {"error": error}
    if body.get("stream"):
        return 200, _chunks(result)
    return 200, result.model_dump(exclude_none=True)


async def _chunks(stream: Any) -> AsyncIterator[dict[str, Any]]:
    async for chunk in stream:
        yield chunk.model_dump(exclude_none=True)
