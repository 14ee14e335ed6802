"""LLM calls an agent makes with its own OpenAI client, recorded as GenAI spans of its rollout.

Calls through the rollout's LLM resource are recorded by the run's LLM proxy, token ids included. An agent that
makes its own `OpenAI()` (agent-lightning's examples do) bypasses the proxy; OpenTelemetry's OpenAI instrumentation
(opentelemetry-instrumentation-openai) records those calls, with `gen_ai.*` attributes and no token ids. It reports
to a provider of ours, never the global one, whose processor (the tracer's) hands each span to the trace context
active where the call is made.
"""

from __future__ import annotations

import logging
import threading

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

logger = logging.getLogger(__name__)

API_BASE = "gen_ai.openai.api_base"
"""Where the instrumented client sent the call (its base URL)."""
HEADER_ATTRIBUTES = ("gen_ai.headers", "llm.headers")
"""Request headers the instrumentation records when the agent passes some: they may hold credentials."""

_lock = threading.RLock()
_armed = False
_provider: TracerProvider | None = None


def instrument_openai(processor: SpanProcessor, span_limits: SpanLimits) -> None:
    """Instrument the OpenAI SDK for this process, once, its spans going to `processor` (later calls do nothing):
    now where the SDK is imported already, else when it is (a post-import hook), so that a process whose agents
    never import it pays nothing (the SDK and the instrumentation take seconds to import on a busy CPU). Nothing
    happens where the instrumentation is not installed, or where something else has instrumented the SDK already."""
    global _armed
    with _lock:
        if _armed:
            return
        _armed = True
        import wrapt

        # Under the lock: where the SDK is imported already, the hook runs here and now, and the other runner
        # threads that call this wait for it, so that their agents' first calls are recorded too.
        wrapt.register_post_import_hook(lambda _module: _instrument(processor, span_limits), "openai")


def _instrument(processor: SpanProcessor, span_limits: SpanLimits) -> None:
    global _provider
    with _lock:
        if _provider is not None:
            return
        _provider = TracerProvider(
            sampler=ALWAYS_ON,
            resource=Resource({"service.name": "lightning"}),
            span_limits=span_limits,
            shutdown_on_exit=False,
        )
        _provider.add_span_processor(processor)
        try:
            # The SDK imports its resources on a client's first use (`client.chat`: `openai.resources` first, then
            # its submodules), the instrumentation each submodule it wraps directly (`openai.resources.chat.
            # completions` first, then its parents). Both at once in two threads (an agent's first call in one
            # runner thread while another arms the tracer) take the modules' import locks in opposite orders:
            # Python raises _DeadlockError in the agent. Importing them here, from the top, first, rules that out.
            import openai.resources  # noqa: F401
            from opentelemetry.instrumentation.openai import OpenAIInstrumentor

            # No trace context propagation: it would add a `traceparent` header to the agent's requests.
            OpenAIInstrumentor(enable_trace_context_propagation=False).instrument(tracer_provider=_provider)
        except ImportError as exc:  # no instrumentation: nothing to record
            logger.debug("the OpenAI SDK is not instrumented: %s", exc)
