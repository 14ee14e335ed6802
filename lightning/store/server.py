"""The store over HTTP: `POST /v1/store/<method>` for every request of `lightning.store.contract` (the request
model is the body, its `response` the answer), plus OTLP/HTTP trace ingestion at /v1/traces."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from lightning.serving import CLIENT_GONE, DEFAULT_MAX_BODY_BYTES, BearerAuth, BodyLimit, without_fastapi_telemetry
from lightning.store import contract
from lightning.store.agl_routes import PathToken, agl_openapi, agl_routes
from lightning.store.base import LightningStore, describe_validation_error, handle_one_http_request
from lightning.store.contract import REQUESTS
from lightning.store.errors import InvalidArgumentError, StoreError, http_status
from lightning.store.otlp import add_otlp_route, otlp_or, otlp_refusal

logger = logging.getLogger(__name__)

BODY_SETTING = "--max-body-mb of `lightning store serve`"
"""What sets the largest request body the store server takes (413 beyond), named in its 413s."""


# --- errors -----------------------------------------------------------------------------------


def _error(status_code: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status_code)


def _too_large(message: str) -> Any:
    return otlp_or(_error(413, message), 413, message)


def _unauthorised() -> JSONResponse:
    return JSONResponse(
        {"detail": "missing or wrong bearer token (Authorization: Bearer <token>)"},
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
    )


class _StoreRoute(APIRoute):
    """A route whose endpoint takes `body` (a request model) and `request`. FastAPI builds the OpenAPI schema from
    that signature as usual; a request takes a shorter path than FastAPI's own (a quarter of a millisecond less
    per call): pydantic validates the body straight from the JSON bytes and dumps the answer straight to JSON
    bytes. Every error becomes status code + message; tracebacks stay in the server log."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        body_model: type[pydantic.BaseModel] | None = self.endpoint.__annotations__.get("body")
        answer = pydantic.TypeAdapter(Any if self.response_model is None else self.response_model)
        endpoint = self.endpoint

        async def handle(request: Request) -> Response:
            try:
                arguments: dict[str, Any] = {"request": request}
                if body_model is not None:
                    arguments["body"] = body_model.model_validate_json(await request.body() or b"{}")
                result = await endpoint(**arguments)
                if isinstance(result, Response):
                    return result
                return Response(answer.dump_json(result), media_type="application/json")
            except pydantic.ValidationError as exc:
                return _error(422, describe_validation_error(exc, "body"))
            except ClientDisconnect:
                return _error(400, CLIENT_GONE)
            except StoreError as exc:
                return _error(http_status(exc), str(exc))
            except Exception:
                logger.exception("unexpected error in %s %s", request.method, request.url.path)
                return _error(500, "internal server error; see the store server's log")

        return handle


class _StoreRoutes:
    """ASGI middleware: `POST /v1/store/<method>` straight to its route's handler, past FastAPI's exception
    middlewares and route matching (about 35 us of a request's 300 us of server CPU, py-spy); the rest to the app.
    Inside the token check: added before it."""

    def __init__(self, app: Any, handlers: dict[str, Callable[[Request], Awaitable[Response]]]) -> None:
        self.app = app
        self.handlers = handlers

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        handler = self.handlers.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        response = await handler(Request(scope, receive, send))
        await response(scope, receive, send)


# --- the app ----------------------------------------------------------------------------------


def create_app(
    store: LightningStore, *, token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> FastAPI:
    """The HTTP face of `store`. With `token`, every request needs `Authorization: Bearer <token>`; a body over
    `max_body_bytes` is answered 413 (`BodyLimit`: by its declared length, or while a chunked one is read).

    The app does not close the store: whoever opened it does (`lightning store serve` on shutdown)."""
    app = FastAPI(
        title="lightning store",
        description="The store protocol (lightning.store.contract) over HTTP, and OTLP/HTTP traces.",
        version="1",
        **without_fastapi_telemetry(),
    )
    app.state.store = store
    # Routes go on the app itself: through include_router, FastAPI's route matching costs 0.15 ms a request.
    app.router.route_class = _StoreRoute

    @app.get("/health", tags=["health"])
    async def health(request: Request) -> dict[str, Any]:
        """The store answers: its statistics."""
        return {"status": "ok", "statistics": await store.statistics()}

    for request_type in REQUESTS:
        app.router.add_api_route(
            f"/v1/store/{request_type.method}",
            _endpoint(store, request_type),
            methods=["POST"],
            response_model=request_type.response,
            tags=[_tag(request_type.method)],
            description=request_type.__doc__,
        )
    store_routes = [r for r in app.router.routes if isinstance(r, _StoreRoute) and r.path.startswith("/v1/store/")]
    app.add_middleware(_StoreRoutes, handlers={route.path: route.get_route_handler() for route in store_routes})
    # agent-lightning 0.3's wire (/v1/agl/...), for its own client and runners; in the API schema beside ours.
    app.router.routes.extend(agl_routes(store))
    _describe_agl_routes(app)
    add_otlp_route(app, store)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, refusal=_too_large, setting=BODY_SETTING)
    if token is not None:
        if not token:
            raise InvalidArgumentError("token must be a non-empty string, or None for no authentication")
        app.add_middleware(BearerAuth, token=token, refusal=otlp_refusal(_unauthorised))
        app.add_middleware(PathToken)  # outermost: /t/<token>/... becomes a bearer token before the check
    return app


def _describe_agl_routes(app: FastAPI) -> None:
    """Add agl's routes (plain Starlette routes, which FastAPI leaves out) to the app's OpenAPI schema."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            paths, schemas = agl_openapi()
            schema["paths"].update(paths)
            known = schema.setdefault("components", {}).setdefault("schemas", {})
            known.update({name: value for name, value in schemas.items() if name not in known})
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _endpoint(store: LightningStore, request_type: type[contract.Request]) -> Callable[..., Awaitable[Any]]:
    """The route of one store method: the body is its request, handed to the store; waits are capped per request."""

    async def endpoint(body: contract.Request, request: Request) -> Any:
        if isinstance(body, contract.QuerySpans):
            # SqlLightningStore answers with the spans' stored JSON as is: no Span models built and dumped again.
            as_json = getattr(store, "query_spans_json", None)
            if as_json is not None:
                return Response(await as_json(body), media_type="application/json")
        return await handle_one_http_request(store, body, request.is_disconnected)

    endpoint.__name__ = request_type.method
    endpoint.__doc__ = request_type.__doc__
    endpoint.__annotations__ = {"body": request_type, "request": Request, "return": request_type.response}
    return endpoint


def _tag(method: str) -> str:
    for tag in ("span", "attempt", "resources", "worker", "rollout"):
        if tag in method:
            return f"{tag}s".replace("resourcess", "resources")
    return "housekeeping"
