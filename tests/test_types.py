"""Validation and behaviour of the shared data model in lightning.types."""

from __future__ import annotations

import pytest
from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import TracerProvider
from pydantic import TypeAdapter, ValidationError

from lightning.types import (
    ATTEMPT_STATUSES,
    LLM,
    ROLLOUT_STATUSES,
    Attempt,
    AttemptedRollout,
    EnqueueRolloutRequest,
    NamedResources,
    PromptTemplate,
    ProxyLLM,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    Span,
    Worker,
    new_attempt_id,
    new_resources_id,
    new_rollout_id,
    route_signature,
)


def _attempt(**kwargs: object) -> Attempt:
    return Attempt(**{"rollout_id": "ro-1", "attempt_id": "at-1", "sequence_id": 1, "start_time": 0.0, **kwargs})


# --- statuses --------------------------------------------------------------------------------


@pytest.mark.parametrize("status", ROLLOUT_STATUSES)
def test_rollout_accepts_every_rollout_status(status: str) -> None:
    assert Rollout(rollout_id="ro-1", input=None, start_time=0.0, status=status).status == status


@pytest.mark.parametrize("status", ["bogus", "timeout", "unresponsive", "QUEUING", ""])
def test_rollout_rejects_other_statuses(status: str) -> None:
    with pytest.raises(ValidationError):
        Rollout(rollout_id="ro-1", input=None, start_time=0.0, status=status)


@pytest.mark.parametrize("status", ATTEMPT_STATUSES)
def test_attempt_accepts_every_attempt_status(status: str) -> None:
    assert _attempt(status=status).status == status


@pytest.mark.parametrize("status", ["queuing", "requeuing", "cancelled", "bogus"])
def test_attempt_rejects_other_statuses(status: str) -> None:
    with pytest.raises(ValidationError):
        _attempt(status=status)


def test_defaults() -> None:
    rollout = Rollout(rollout_id="ro-1", input={"q": 1}, start_time=1.0)
    assert rollout.status == "queuing"
    assert rollout.config == RolloutConfig()
    assert _attempt().status == "preparing"
    assert Worker(worker_id="w").status == "unknown"


def test_worker_status_validated() -> None:
    assert Worker(worker_id="w", status="busy").status == "busy"
    with pytest.raises(ValidationError):
        Worker(worker_id="w", status="sleeping")


def test_rollout_mode_validated() -> None:
    assert Rollout(rollout_id="ro-1", input=None, start_time=0.0, mode="val").mode == "val"
    with pytest.raises(ValidationError):
        Rollout(rollout_id="ro-1", input=None, start_time=0.0, mode="eval")


def test_new_ids_have_prefixes_and_differ() -> None:
    assert new_rollout_id().startswith("ro-")
    assert new_attempt_id().startswith("at-")
    assert new_resources_id().startswith("rs-")
    assert len({new_rollout_id() for _ in range(100)}) == 100


# --- RolloutConfig ---------------------------------------------------------------------------


def test_rollout_config_defaults() -> None:
    config = RolloutConfig()
    assert config.max_attempts == 1
    assert config.retry_condition == []
    assert config.timeout_seconds is None and config.unresponsive_seconds is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"max_attempts": -1},
        {"timeout_seconds": 0},
        {"timeout_seconds": -1.5},
        {"unresponsive_seconds": 0},
        {"retry_condition": ["bogus"]},
        {"retry_condition": ["queuing"]},
    ],
)
def test_rollout_config_rejects(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        RolloutConfig(**kwargs)


def test_rollout_config_accepts_attempt_statuses_as_retry_condition() -> None:
    config = RolloutConfig(max_attempts=3, retry_condition=["failed", "timeout", "unresponsive"], timeout_seconds=0.5)
    assert RolloutConfig.model_validate_json(config.model_dump_json()) == config


# --- AttemptedRollout, EnqueueRolloutRequest -------------------------------------------------


def test_attempted_rollout_requires_matching_rollout_id() -> None:
    ok = AttemptedRollout(rollout_id="ro-1", input=None, start_time=0.0, attempt=_attempt())
    assert ok.attempt.rollout_id == ok.rollout_id
    with pytest.raises(ValidationError, match="differs"):
        AttemptedRollout(rollout_id="ro-2", input=None, start_time=0.0, attempt=_attempt())


def test_enqueue_request_idempotency_key_bounds() -> None:
    assert EnqueueRolloutRequest(input=1, idempotency_key="k").idempotency_key == "k"
    assert EnqueueRolloutRequest(input=1).idempotency_key is None
    with pytest.raises(ValidationError):
        EnqueueRolloutRequest(input=1, idempotency_key="")
    with pytest.raises(ValidationError):
        EnqueueRolloutRequest(input=1, idempotency_key="k" * 256)


# --- resources -------------------------------------------------------------------------------


def test_resources_round_trip_through_json_by_resource_type() -> None:
    update = ResourcesUpdate(
        resources_id="rs-1",
        create_time=1.0,
        update_time=2.0,
        version=3,
        resources={
            "main": LLM(endpoint="http://a/v1", model="m", sampling_parameters={"temperature": 0.7}),
            "proxied": ProxyLLM(endpoint="http://p/v1", model="m2"),
            "prompt": PromptTemplate(template="Hi {{ name }}", engine="jinja"),
        },
    )
    back = ResourcesUpdate.model_validate_json(update.model_dump_json())
    assert type(back.resources["main"]) is LLM
    assert type(back.resources["proxied"]) is ProxyLLM
    assert type(back.resources["prompt"]) is PromptTemplate
    assert back == update


def test_resources_from_plain_dicts_pick_type_by_discriminator() -> None:
    adapter = TypeAdapter(NamedResources)
    parsed = adapter.validate_python(
        {
            "a": {"resource_type": "llm", "endpoint": "http://a", "model": "m"},
            "b": {"resource_type": "proxy_llm", "endpoint": "http://b", "model": "m"},
            "c": {"resource_type": "prompt_template", "template": "{x}"},
        }
    )
    assert [type(v) for v in parsed.values()] == [LLM, ProxyLLM, PromptTemplate]


@pytest.mark.parametrize(
    "raw",
    [
        {"resource_type": "database", "endpoint": "http://a", "model": "m"},
        {"endpoint": "http://a", "model": "m"},
        {"resource_type": "llm", "model": "m"},
    ],
)
def test_resources_reject_unknown_or_incomplete(raw: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        TypeAdapter(NamedResources).validate_python({"x": raw})


def test_llm_api_key_not_in_repr() -> None:
    llm = LLM(endpoint="http://a/v1", model="m", api_key="sk-secret")
    assert "sk-secret" not in repr(llm)
    assert llm.base_url == "http://a/v1"
    assert llm.get_base_url("ro-1", "at-1") == "http://a/v1"


# --- PromptTemplate --------------------------------------------------------------------------


def test_prompt_template_f_string() -> None:
    assert PromptTemplate(template="Solve {task} in {n} steps").format(task="x+1=2", n=3) == ("Solve x+1=2 in 3 steps")


def test_prompt_template_f_string_missing_placeholder() -> None:
    with pytest.raises(ValueError, match="task"):
        PromptTemplate(template="Solve {task}").format(other=1)


def test_prompt_template_jinja() -> None:
    template = PromptTemplate(template="{% for x in xs %}{{ x }},{% endfor %} {{ name }}", engine="jinja")
    assert template.format(xs=[1, 2], name="Ada") == "1,2, Ada"


def test_prompt_template_jinja_missing_placeholder() -> None:
    with pytest.raises(ValueError, match="name"):
        PromptTemplate(template="Hi {{ name }}", engine="jinja").format()


def test_prompt_template_rejects_unknown_engine() -> None:
    with pytest.raises(ValidationError):
        PromptTemplate(template="x", engine="mustache")


# --- ProxyLLM --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("http://proxy:8000/v1", "http://proxy:8000/rollout/ro-1/attempt/at-1/v1"),
        ("http://proxy:8000/v1/", "http://proxy:8000/rollout/ro-1/attempt/at-1/v1"),
        ("http://proxy:8000", "http://proxy:8000/rollout/ro-1/attempt/at-1"),
        ("http://proxy:8000/", "http://proxy:8000/rollout/ro-1/attempt/at-1"),
        ("http://proxy:8000/api/v1", "http://proxy:8000/api/rollout/ro-1/attempt/at-1/v1"),
    ],
)
def test_proxy_llm_get_base_url(endpoint: str, expected: str) -> None:
    assert ProxyLLM(endpoint=endpoint, model="m").get_base_url("ro-1", "at-1") == expected


def test_proxy_llm_get_base_url_without_ids_is_endpoint() -> None:
    assert ProxyLLM(endpoint="http://proxy:8000/v1", model="m").get_base_url() == "http://proxy:8000/v1"


@pytest.mark.parametrize(("rollout_id", "attempt_id"), [("ro-1", None), (None, "at-1"), ("", "at-1")])
def test_proxy_llm_get_base_url_needs_both_ids(rollout_id: str | None, attempt_id: str | None) -> None:
    with pytest.raises(ValueError, match="both"):
        ProxyLLM(endpoint="http://proxy:8000/v1", model="m").get_base_url(rollout_id, attempt_id)


def test_proxy_llm_with_attempted_rollout_gives_plain_llm() -> None:
    proxy = ProxyLLM(endpoint="http://proxy/v1", model="m", api_key="k", sampling_parameters={"top_p": 0.9})
    rollout = AttemptedRollout(rollout_id="ro-1", input=None, start_time=0.0, attempt=_attempt())
    llm = proxy.with_attempted_rollout(rollout)
    assert type(llm) is LLM
    # With the proxy's token as api_key, the route is signed: the proxy need not ask the store about the attempt.
    assert llm.endpoint == f"http://proxy/rollout/ro-1/attempt/at-1/signed/{route_signature('k', 'ro-1', 'at-1')}/v1"
    assert (llm.model, llm.api_key, llm.sampling_parameters) == ("m", "k", {"top_p": 0.9})
    unsigned = ProxyLLM(endpoint="http://proxy/v1", model="m").with_attempted_rollout(rollout)
    assert unsigned.endpoint == "http://proxy/rollout/ro-1/attempt/at-1/v1"
    assert route_signature("k", "ro-1", "at-1") != route_signature("other", "ro-1", "at-1")


# --- Span ------------------------------------------------------------------------------------


def test_span_from_opentelemetry() -> None:
    provider = TracerProvider()  # private; never the global one
    tracer = provider.get_tracer("lightning-tests")
    with (
        tracer.start_as_current_span("root") as root,
        tracer.start_as_current_span("child", attributes={"ids": (1, 2), "s": "x"}) as child,
    ):
        child.add_event("e", {"v": 1})
    provider.shutdown()

    span = Span.from_opentelemetry(child, "ro-1", "at-1", 7)
    assert (span.rollout_id, span.attempt_id, span.sequence_id, span.name) == ("ro-1", "at-1", 7, "child")
    assert span.span_id == trace_api.format_span_id(child.get_span_context().span_id)
    assert span.parent_id == trace_api.format_span_id(root.get_span_context().span_id)
    assert span.attributes == {"ids": [1, 2], "s": "x"}
    assert [e.name for e in span.events] == ["e"]
    assert span.start_time is not None and span.end_time is not None and span.end_time >= span.start_time
    assert Span.model_validate_json(span.model_dump_json()) == span

    root_span = Span.from_opentelemetry(root, "ro-1", "at-1", 8)
    assert root_span.parent_id is None and root_span.parent is None


def test_span_from_opentelemetry_keeps_each_providers_resource_links_and_a_nul_check() -> None:
    """The resource is converted once a provider (spans of two providers, taking turns, keep their own), links come
    across, and a span name the store cannot hold is still refused by validation."""
    from opentelemetry.sdk.resources import Resource

    made = []
    for name in ("one", "two", "one", "two"):
        provider = TracerProvider(resource=Resource.create({"service.name": name}))
        span = provider.get_tracer("t").start_span("s")
        span.end()
        made.append((name, Span.from_opentelemetry(span, "ro-1", "at-1", 0)))
    assert [span.resource.attributes["service.name"] for _, span in made] == [name for name, _ in made]
    made[0][1].resource.attributes["changed"] = True  # a span's resource is its own to change
    assert "changed" not in made[2][1].resource.attributes

    provider = TracerProvider()
    tracer = provider.get_tracer("t")
    first = tracer.start_span("first")
    first.end()
    linked = tracer.start_span("linked", links=[trace_api.Link(first.get_span_context(), {"why": ("a", "b")})])
    linked.end()
    span = Span.from_opentelemetry(linked, "ro-1", "at-1", 0)
    assert span.links[0].context.span_id == trace_api.format_span_id(first.get_span_context().span_id)
    assert span.links[0].attributes == {"why": ["a", "b"]}
    bad = tracer.start_span("nul\x00name")
    bad.end()
    with pytest.raises(ValueError, match="name"):
        Span.from_opentelemetry(bad, "ro-1", "at-1", 0)
