"""Run in a fresh interpreter (tests/test_fleet_agent_clients.py): one thread arms the OpenAI instrumentation while
five others make a client's first use of the SDK (`client.chat.completions`, which imports its resources), all at
once. Prints one JSON line: the errors the threads met, and whether the SDK was instrumented."""

from __future__ import annotations

import json
import sys
import threading

from openai import OpenAI
from opentelemetry.sdk.trace import SpanLimits
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from lightning.tracing.instrument import instrument_openai

THREADS = 6


def main() -> None:
    assert "openai.resources" not in sys.modules, "the SDK's resources are imported already: nothing to race"
    barrier = threading.Barrier(THREADS)
    errors: list[str] = []

    def arm() -> None:
        barrier.wait()
        instrument_openai(SimpleSpanProcessor(InMemorySpanExporter()), SpanLimits())

    def first_use() -> None:
        barrier.wait()
        try:
            OpenAI(api_key="dummy", base_url="http://127.0.0.1:9/v1").chat.completions  # noqa: B018
        except BaseException as exc:  # _DeadlockError is not an Exception's subclass one would guess
            errors.append(repr(exc))

    threads = [threading.Thread(target=arm)] + [threading.Thread(target=first_use) for _ in range(THREADS - 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    from opentelemetry.instrumentation.openai import OpenAIInstrumentor  # here: the arming thread imports it

    print(json.dumps({"errors": errors, "instrumented": OpenAIInstrumentor().is_instrumented_by_opentelemetry}))


if __name__ == "__main__":
    main()
