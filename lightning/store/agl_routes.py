"""agent-lightning 0.3's store wire, served beside ours: its REST routes under `/v1/agl/...`, so its own
`LightningStoreClient` (and the runners and trainers built on it) work against our store unchanged.

Each route turns its path, query and body into the request model of `lightning.store.contract` that our own
route `POST /v1/store/<method>` takes, hands it to the same store, and answers in agl's shape (paginated queries,
`{"sequence_id": n}`, 201 on creation) with agl's status codes for bad requests: 400 for an explicit null where agl
refuses one, for bad sorting or paging and for an argument the store refuses; 422 for a body that does not fit.

agl's client cannot send a bearer token: on a server with a token, give it the token as the first part of the
address, `LightningStoreClient("http://host:4747/t/<token>")`; the server strips `/t/<token>` and checks it like a
bearer token (see `PathToken`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

import pydantic
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from lightning.serving import CLIENT_GONE
from lightning.store import contract
from lightning.store.agl_answers import answer_as_agl
from lightning.store.base import LightningStore, describe_validation_error, handle_one_http_request
from lightning.store.errors import InvalidArgumentError, StoreError, http_status

logger = logging.getLogger(__name__)

PREFIX = "/v1/agl"
TOKEN_PREFIX = "/t/"


@dataclass(frozen=True)
class AglRoute:
    """One of agl's routes: which of our requests it is, and how its body and answer differ from ours."""

    method: str
    path: str
    request: type[contract.Request]
    status_code: int = 200
    body_is: str | None = None
    """agl sends this field of the request as the whole body (a span, a resources mapping)."""
    answer: Callable[[Any], Any] = lambda value: value
    list_fields: tuple[str, ...] = ()
    """Query-string parameters that may repeat (GET): the values form a list."""
    not_null: tuple[str, ...] = ()
    """Fields that agl's server refuses as an explicit null (400): for these, left out ("unset", keep the value) and
    null differ, and null is not a value."""


# Fixed paths before the ones with an {id} in the same place: the first route whose path and method match wins.
ROUTES: tuple[AglRoute, ...] = (
    AglRoute("POST", "/queues/rollouts/enqueue", contract.EnqueueManyRollouts, 201),
    AglRoute("POST", "/queues/rollouts/dequeue", contract.DequeueRollouts),
    AglRoute("POST", "/rollouts", contract.StartRollout, 201),
    AglRoute("GET", "/rollouts", contract.QueryRollouts, list_fields=("status_in", "rollout_id_in")),
    AglRoute("POST", "/rollouts/search", contract.QueryRollouts),
    AglRoute("GET", "/rollouts/{rollout_id}", contract.GetRolloutById),
    AglRoute("POST", "/rollouts/{rollout_id}", contract.UpdateRollout, not_null=("status", "config")),
    AglRoute("POST", "/rollouts/{rollout_id}/attempts", contract.StartAttempt, 201),
    AglRoute("GET", "/rollouts/{rollout_id}/attempts", contract.QueryAttempts),
    AglRoute("POST", "/rollouts/{rollout_id}/attempts/search", contract.QueryAttempts),
    AglRoute("GET", "/rollouts/{rollout_id}/attempts/latest", contract.GetLatestAttempt),
    AglRoute(
        "POST",
        "/rollouts/{rollout_id}/attempts/{attempt_id}",
        contract.UpdateAttempt,
        not_null=("status", "worker_id", "last_heartbeat_time", "metadata"),
    ),
    AglRoute("GET", "/workers", contract.QueryWorkers, list_fields=("status_in",)),
    AglRoute("POST", "/workers/search", contract.QueryWorkers),
    AglRoute("GET", "/workers/{worker_id}", contract.GetWorkerById),
    AglRoute("POST", "/workers/{worker_id}", contract.UpdateWorker, not_null=("heartbeat_stats",)),
    AglRoute("GET", "/statistics", contract.Statistics),
    AglRoute("GET", "/resources", contract.QueryResources),
    AglRoute("POST", "/resources", contract.AddResources, 201, body_is="resources"),
    AglRoute("GET", "/resources/latest", contract.GetLatestResources),
    AglRoute("GET", "/resources/{resources_id}", contract.GetResourcesById),
    AglRoute("POST", "/resources/{resources_id}", contract.UpdateResources, body_is="resources"),
    AglRoute("POST", "/spans", contract.AddSpan, 201, body_is="span"),
    AglRoute("GET", "/spans", contract.QuerySpans),
    AglRoute("POST", "/spans/search", contract.QuerySpans),
    AglRoute("POST", "/spans/next", contract.GetNextSpanSequenceId, answer=lambda n: {"sequence_id": n}),
    AglRoute("POST", "/waits/rollouts", contract.WaitForRollouts),
)


def agl_routes(store: LightningStore) -> list[Route]:
    """The Starlette routes of agl's wire on `store`."""
    routes = [Route(PREFIX + "/health", _health, methods=["GET"], include_in_schema=False)]
    for route in ROUTES:
        routes.append(
            Route(PREFIX + route.path, _endpoint(store, route), methods=[route.method], include_in_schema=False)
        )
    return routes


def agl_openapi(ref_template: str = "#/components/schemas/{model}") -> tuple[dict[str, Any], dict[str, Any]]:
    """agl's routes as OpenAPI paths, and the schemas they refer to (for `components.schemas`): the path's ids as
    path parameters, a GET's fields as query parameters, a POST's request (or its `body_is` field) as the JSON body.
    So the API docs list them and a schema-driven fuzzer finds them."""
    paths: dict[str, Any] = {}
    schemas: dict[str, Any] = {}
    for route in ROUTES:
        schema = route.request.model_json_schema(ref_template=ref_template)
        schemas.update(schema.pop("$defs", {}))
        in_path = re.findall(r"{(\w+)}", route.path)
        parameters = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in in_path]
        properties = {name: value for name, value in schema.get("properties", {}).items() if name not in in_path}
        operation: dict[str, Any] = {
            "summary": f"agent-lightning 0.3: {route.request.method}",
            "description": route.request.__doc__ or "",
            "tags": ["agent-lightning"],
            "responses": {str(route.status_code): {"description": "agl's answer"}},
        }
        if route.method == "GET":
            for name, value in properties.items():
                if name in route.list_fields:
                    value = {"type": "array", "items": value}
                parameters.append({"name": name, "in": "query", "required": False, "schema": value})
        elif route.body_is is not None:
            body = properties[route.body_is]
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        else:
            required = [name for name in schema.get("required", []) if name not in in_path]
            body = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
            operation["requestBody"] = {"required": False, "content": {"application/json": {"schema": body}}}
        if parameters:
            operation["parameters"] = parameters
        paths.setdefault(PREFIX + route.path, {})[route.method.lower()] = operation
    return paths, schemas


async def _health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


def _endpoint(store: LightningStore, route: AglRoute) -> Callable[..., Any]:
    answer_type = pydantic.TypeAdapter(route.request.response)

    async def endpoint(request: Request) -> Response:
        fields: dict[str, Any] = {}
        try:
            fields = await _fields(request, route)
            for name in route.not_null:
                if name in fields and fields[name] is None:
                    return _error(400, f"{name} is invalid; it cannot be a null value.")
            call = route.request.model_validate(fields)
            if isinstance(call, contract.Page) and call.limit == 0:
                return _error(400, "Limit must be greater than 0 or -1 for no limit")
            result = await _answer(store, call, request)
            body = answer_type.dump_python(result, mode="json")
            return JSONResponse(route.answer(body), status_code=route.status_code)
        except pydantic.ValidationError as exc:
            return _validation_error(route, exc, fields)
        except ClientDisconnect:
            return _error(400, CLIENT_GONE)
        except InvalidArgumentError as exc:
            return _error(400, str(exc))  # agl's "bad request: do not retry"
        except StoreError as exc:
            return _error(http_status(exc), str(exc))
        except json.JSONDecodeError as exc:
            return _error(400, f"{route.request.method}: the body is not JSON: {exc}")
        except UnicodeDecodeError as exc:
            return _error(400, f"{route.request.method}: the body is not UTF-8 text (JSON is): {exc}")
        except Exception:
            logger.exception("unexpected error in %s %s", request.method, request.url.path)
            return _error(500, "internal server error; see the store server's log")

    endpoint.__name__ = f"agl_{route.request.method}"
    return endpoint


async def _answer(store: LightningStore, call: contract.Request, request: Request) -> Any:
    """Our store's answer to `call`, with agl's for rollout ids it does not know (lightning.store.agl_answers)."""

    def handle(call: contract.Request) -> Any:
        return handle_one_http_request(store, call, request.is_disconnected)

    return await answer_as_agl(store, call, handle)


async def _fields(request: Request, route: AglRoute) -> dict[str, Any]:
    """The request's arguments: the path's ids, then the query string (GET) or the JSON body (POST)."""
    fields: dict[str, Any] = {}
    if route.method == "GET":
        for name in request.query_params:
            values = request.query_params.getlist(name)
            fields[name] = values if name in route.list_fields else values[-1]
    else:
        raw = await request.body()
        body = json.loads(raw) if raw.strip() else None
        if route.body_is is not None:
            fields[route.body_is] = body
        elif body is not None:
            if not isinstance(body, dict):
                raise InvalidArgumentError(f"{route.request.method}: the body must be a JSON object")
            fields.update(body)
    fields.update(request.path_params)
    return fields


PAGE_FIELDS = frozenset({"sort_by", "sort_order", "limit", "offset", "filter_logic"})


def _validation_error(route: AglRoute, exc: pydantic.ValidationError, fields: dict[str, Any]) -> JSONResponse:
    """agl's answers to a request that does not fit: its server checks the sorting, paging and filter logic of a
    query itself (400, naming the allowed values), and leaves the rest of the body to FastAPI's validation (422)."""
    wrong = {str(error["loc"][0]) for error in exc.errors() if error.get("loc")}
    if not wrong or not wrong <= PAGE_FIELDS:
        return _error(422, f"{route.request.method}: {describe_validation_error(exc, 'body')}")
    if "sort_by" in wrong:
        allowed = ", ".join(_literal_values(route.request.model_fields["sort_by"].annotation))
        return _error(400, f"Invalid sort_by: {fields.get('sort_by')}, allowed fields are: {allowed}")
    return _error(400, f"{route.request.method}: {describe_validation_error(exc, 'body')}")


def _literal_values(annotation: Any) -> list[str]:
    """The strings a `Literal[...] | None` annotation allows."""
    if get_origin(annotation) is Literal:
        return [str(value) for value in get_args(annotation)]
    return [value for arg in get_args(annotation) for value in _literal_values(arg)]


def _error(status_code: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status_code)


class PathToken:
    """ASGI middleware for clients that cannot send a header (agl's `LightningStoreClient`): a path that starts with
    `/t/<token>/` is served as the rest of the path with `Authorization: Bearer <token>`, which the bearer check
    after this one then judges. The path is rewritten in place, so access logs never show the token."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(TOKEN_PREFIX):
            token, slash, rest = scope["path"][len(TOKEN_PREFIX) :].partition("/")
            if token and slash:
                scope["path"] = "/" + rest
                scope["raw_path"] = scope["path"].encode()
                headers = [(name, value) for name, value in scope["headers"] if name != b"authorization"]
                scope["headers"] = [*headers, (b"authorization", f"Bearer {token}".encode())]
        await self.app(scope, receive, send)
