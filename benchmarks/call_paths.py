"""Two per-rollout paths of issue 39, each beside the path it replaced, measured in one run (CPU of this process):

- a reward span in a runner's hand-over trace context: recorded without the OpenTelemetry SDK's span machinery
  (`Tracer.record_instant`, our processor alone on the provider) against through the SDK (what a provider with a
  processor of someone else's still takes: one is added here);
- the LLM proxy's call to a hot route of the inference server in its process (`lightning.proxy.local`): the route's
  handler awaited directly against the app run as an ASGI task (what an app without hot routes still takes), beside
  the handler alone. The handler is a stand-in: it parses a chat request and answers a small completion;
- a phase's rollout summary reading its rollouts' spans: all of them, or only those that may carry a reward
  (`query_latest_spans(rewards_only=True)`); one "call" is the whole phase's read.

    .venv/bin/python benchmarks/call_paths.py [--calls 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fastapi import FastAPI  # noqa: E402
from opentelemetry.sdk.trace import SpanProcessor  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import Response  # noqa: E402

from lightning import fastjson  # noqa: E402
from lightning.proxy.local import InProcessSession  # noqa: E402
from lightning.serving import BodyLimit, HotRoutes, ours_outermost, past_guards  # noqa: E402
from lightning.store import SqlLightningStore  # noqa: E402
from lightning.tracing import Tracer, emit_reward  # noqa: E402

REQUEST = fastjson.dumps({"model": "policy", "messages": [{"role": "user", "content": "bdfg"}], "max_tokens": 2})
ANSWER = {"id": "chatcmpl-1", "choices": [{"index": 0, "message": {"role": "assistant", "content": "g"}}]}
URL = "http://127.0.0.1:9/v1/chat/completions"  # nothing listens: the answer comes from the app in this process


async def per_call(call: Callable[[], Awaitable[Any]], calls: int) -> float:
    """Microseconds of this process's CPU a call, `calls` calls one after another (after a tenth as many unmeasured)."""
    for _ in range(calls // 10):
        await call()
    started = time.process_time()
    for _ in range(calls):
        await call()
    return (time.process_time() - started) / calls * 1e6


async def reward_spans(calls: int, rounds: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as workdir:
        store = SqlLightningStore(f"sqlite:///{workdir}/store.db", watchdog_interval=None)
        instant, sdk = Tracer(store), Tracer(store)
        sdk.tracer_provider.add_span_processor(SpanProcessor())  # another processor: the SDK's path
        rollout = await store.start_rollout({"task": 1})  # where a span the exporter takes first is written

        def traced(tracer: Tracer) -> Callable[[], Awaitable[None]]:
            async def one() -> None:
                async with tracer.trace_context(rollout.rollout_id, rollout.attempt.attempt_id, hand_over=True):
                    emit_reward(1.0)

            return one

        results: dict[str, list[float]] = {"reward span, without the SDK": [], "reward span, through the SDK": []}
        for _ in range(rounds):
            results["reward span, without the SDK"].append(await per_call(traced(instant), calls))
            results["reward span, through the SDK"].append(await per_call(traced(sdk), calls))
        instant.shutdown()
        sdk.shutdown()
        await store.close()
    return results


async def in_process_calls(calls: int, rounds: int) -> dict[str, list[float]]:
    async def handler(request: Request, match: re.Match[str]) -> Response:
        fastjson.loads(await request.body())
        return Response(fastjson.dumps(ANSWER), media_type="application/json")

    app = ours_outermost(FastAPI())
    app.add_middleware(HotRoutes, routes=[(re.compile("/v1/chat/completions"), handler)], errors={})
    app.add_middleware(BodyLimit, max_bytes=2**20, refusal=lambda message: Response(status_code=413), setting="-")
    entry = past_guards(app)

    async def as_asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await entry(scope, receive, send)  # the same app, its hot routes hidden: run as an ASGI task

    def calling(session: InProcessSession) -> Callable[[], Awaitable[None]]:
        async def one() -> None:
            response = await session.post(URL, data=REQUEST, headers={"content-type": "application/json"})
            await response.read()
            response.release()

        return one

    async def alone() -> None:
        sent = [{"type": "http.request", "body": REQUEST, "more_body": False}]

        async def receive() -> dict[str, Any]:
            return sent.pop()

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b""}
        await handler(Request(scope, receive), re.fullmatch("x", "x"))  # type: ignore[arg-type]

    direct, task = InProcessSession(entry, 60.0), InProcessSession(as_asgi, 60.0)
    names = ("in-process call, the hot route's handler awaited", "in-process call, the app as an ASGI task")
    results: dict[str, list[float]] = {name: [] for name in (*names, "the stand-in handler alone")}
    for _ in range(rounds):
        results[names[0]].append(await per_call(calling(direct), calls))
        results[names[1]].append(await per_call(calling(task), calls))
        results["the stand-in handler alone"].append(await per_call(alone, calls))
    return results


async def summary_reads(rounds: int) -> dict[str, list[float]]:
    """A phase's rollout summary reads its 768 rollouts' latest spans, 256 a request: all of them, or only those that
    may carry a reward. Each rollout has an LLM call's span (a prompt, 30 token ids, 24 attributes) and a reward's."""
    from lightning import semconv
    from lightning.types import Span

    def span(rollout: Any, name: str, attributes: dict[str, Any], number: int) -> Span:
        return Span(
            rollout_id=rollout.rollout_id, attempt_id=rollout.attempt.attempt_id, sequence_id=0,
            trace_id=f"{number:032x}", span_id=f"{number:016x}", name=name, attributes=attributes, start_time=1.0,
            end_time=2.0,
        )  # fmt: skip

    call = {"gen_ai.prompt.0.content": "bdfg", "prompt_token_ids": list(range(30)), "response_token_ids": [5, 2]}
    call |= {f"lightning.llm.attribute{k}": "x" * 20 for k in range(21)}
    results: dict[str, list[float]] = {"a phase's summary read (768 rollouts), all spans": [], "... rewards_only": []}
    with tempfile.TemporaryDirectory() as workdir:
        store = SqlLightningStore(f"sqlite:///{workdir}/store.db", watchdog_interval=None)
        ids = []
        for i in range(768):
            rollout = await store.start_rollout({"letters": "bdfg"})
            ids.append(rollout.rollout_id)
            spans = [span(rollout, "openai.chat.completion", call, 2 * i + 1)]
            spans.append(span(rollout, semconv.REWARD_SPAN, {semconv.REWARD_VALUE: 1.0}, 2 * i + 2))
            await store.finish_attempt(rollout.rollout_id, rollout.attempt.attempt_id, "succeeded", spans)
        for _ in range(rounds):
            for name, only in zip(results, (False, True), strict=True):
                started = time.process_time()
                for start in range(0, len(ids), 256):
                    await store.query_latest_spans(ids[start : start + 256], rewards_only=only)
                results[name].append((time.process_time() - started) * 1e6)
        await store.close()
    return results


async def main(args: argparse.Namespace) -> None:
    results = {**await reward_spans(args.calls, args.rounds), **await in_process_calls(args.calls, args.rounds)}
    print(f"\n{args.rounds} rounds of {args.calls:,} calls each, one after another\n")
    print("| path | us of CPU a call, median of the rounds | least |\n|---|---|---|")
    for name, values in {**results, **await summary_reads(args.rounds)}.items():
        print(f"| {name} | {statistics.median(values):,.1f} | {min(values):,.1f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20_000, help="calls a round, on each path")
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
