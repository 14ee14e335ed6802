"""agent-lightning's adapters, tracers and strategies as its training scripts give them to `Trainer`, with only the
imports changed: `adapter={"agent_match": ...}` (train_sql_agent.py, then `trainer.adapter.agent_match`),
`tracer=OtelTracer(), adapter=LlmProxyTraceToTriplet()` (train_calc_agent.py --llm-proxy), `strategy="shm"` / "cs";
and the adapters' own `adapt(spans)` in agl's triplet shape."""

from __future__ import annotations

import pytest
from test_adapter import llm_span, op_span, reward_span

import lightning as agl
from lightning.adapter import (
    Adapter,
    LlmProxyTraceToTriplet,
    RewardMatchPolicy,
    TraceAdapter,
    TracerTraceToTriplet,
    TraceToMessages,
    TraceToTripletBase,
)

AGENT = agl.rollout(lambda task: 1.0)


def test_agl_s_adapters_adapt_spans_to_triplets_of_agl_s_shape() -> None:
    spans = [
        op_span(1, "writer", 0, 10, attributes={"agent.name": "write"}),
        llm_span(2, "call-1", 1, 2, prompt=[1, 2], responses=[[3]], parent_id="writer"),
        op_span(3, "checker", 3, 9, attributes={"agent.name": "check"}, parent_id="writer"),
        llm_span(4, "call-2", 4, 5, prompt=[1, 2, 3, 9], responses=[[7, 8]], parent_id="checker"),
        reward_span(5, "reward", 0.5, 6, parent_id="checker"),
        reward_span(6, "writer-reward", 0.25, 9.5, parent_id="writer"),
        reward_span(7, "final", 1.0, 11),
    ]
    spans[1].attributes["gen_ai.response.id"] = "chatcmpl-1"

    every = TracerTraceToTriplet().adapt(spans)
    assert [(t.prompt, t.response, t.reward) for t in every] == [
        ({"token_ids": [1, 2]}, {"token_ids": [3]}, 0.5),  # FIRST_OCCURRENCE: the first reward after the call
        ({"token_ids": [1, 2, 3, 9]}, {"token_ids": [7, 8]}, 0.5),
    ]
    assert every[0].metadata["rollout_id"] == "ro-test"
    assert every[0].metadata["response_id"] == "chatcmpl-1" and every[1].metadata["response_id"] is None
    written = TracerTraceToTriplet(agent_match=r"^wri", reward_match=RewardMatchPolicy.FIRST_SIBLING)(spans)
    # Only the call whose nearest agent is "write"; FIRST_SIBLING: the first reward among its later siblings.
    assert [(t.response, t.reward) for t in written] == [({"token_ids": [3]}, 0.25)]
    assert [t.response for t in LlmProxyTraceToTriplet().adapt(spans)] == [{"token_ids": [3]}, {"token_ids": [7, 8]}]
    # agl's class tree: isinstance checks and subclasses of agl code carry over.
    for adapter in (TracerTraceToTriplet(), LlmProxyTraceToTriplet(), TraceToMessages()):
        assert isinstance(adapter, TraceAdapter) and isinstance(adapter, Adapter)
    assert isinstance(LlmProxyTraceToTriplet(), TraceToTripletBase)
    with pytest.raises(ValueError, match="exclude_llm_call_in_reward=False"):
        TracerTraceToTriplet(exclude_llm_call_in_reward=False)


class Counting(TraceAdapter[int]):
    def adapt(self, source):  # type: ignore[no-untyped-def, override]
        return len(source)


def test_a_trainer_takes_agl_s_adapter_tracer_and_strategy_forms() -> None:
    # train_sql_agent.py: a dict of TracerTraceToTriplet's options, read back from trainer.adapter.
    sql = agl.Trainer(n_runners=10, algorithm={"lr": 1e-6}, adapter={"agent_match": None})
    assert isinstance(sql.adapter, TracerTraceToTriplet) and sql.adapter.agent_match is None
    assert isinstance(agl.Trainer().adapter, TracerTraceToTriplet)  # agl's default
    # train_calc_agent.py --llm-proxy: a tracer each runner has one of, the proxy's adapter.
    tracer = agl.OtelTracer()
    calc = agl.Trainer(
        algorithm={"lr": 1e-6}, n_runners=2, store=None, tracer=tracer, adapter=agl.LlmProxyTraceToTriplet()
    )
    assert calc.tracer is tracer and isinstance(calc.adapter, LlmProxyTraceToTriplet)
    tracer.shutdown()
    # Strategies choose where the runners run; a name takes the Trainer's n_runners, an object its own.
    assert agl.Trainer(n_runners=3, strategy="shm").build_config(AGENT, [{"x": 1}]).task_runner == "default"
    cs = agl.Trainer(n_runners=3, strategy={"type": "cs"}).build_config(AGENT, [{"x": 1}])
    assert (cs.task_runner, cs.n_runners) == ("processes", 3)
    strategy = agl.SharedMemoryExecutionStrategy(n_runners=2, main_thread="algorithm")
    assert agl.Trainer(n_runners=5, strategy=strategy).build_config(AGENT, [{"x": 1}]).n_runners == 2
    # An adapter of one's own is a custom algorithm's to read; a run's rows come from ours.
    with pytest.raises(TypeError, match="a run's training rows come from lightning's adapter"):
        agl.Trainer(adapter=Counting())
    assert agl.Trainer(algorithm=agl.algo(lambda: None), adapter=Counting()).adapter.adapt([1, 2]) == 2
    with pytest.raises(ValueError, match="runners run on this process's event loop"):
        agl.Trainer(algorithm=agl.algo(lambda: None), strategy="cs")


def test_agl_s_events_stop_a_runner_s_iter() -> None:
    for event in (agl.ThreadingEvent(), agl.MultiprocessingEvent()):
        assert not event.is_set() and not event.wait(0.01)
        event.set()
        assert event.is_set() and event.wait(0)
        event.clear()
        assert not event.is_set()


@pytest.mark.slow  # 3 s: a proxy started and stopped, its first call (1.2 s of it)
async def test_agl_s_llm_proxy_object_records_a_hosted_vllm_model_s_calls_with_token_ids() -> None:
    """agl's `LLMProxy(port=, model_list=[hosted_vllm ...], store=)` (examples/minimal/llm_proxy.py's form): started,
    called on an attempt's route from `as_resource`, its spans carry token ids that LlmProxyTraceToTriplet adapts."""
    from openai import AsyncOpenAI
    from support.scripted_agl import scripted_chat_app
    from support.servers import serving

    store = agl.InMemoryLightningStore(watchdog_interval=None)
    app = scripted_chat_app(lambda body: {"role": "assistant", "content": "Hello!"})
    with serving(app) as url:
        model_list = [
            {"model_name": "qwen", "litellm_params": {"model": "hosted_vllm/served", "api_base": f"{url}/v1"}}
        ]
        proxy = agl.LLMProxy(model_list=model_list, store=store, launch_mode="thread")
        await proxy.start()
        try:
            rollout = await store.start_rollout({"origin": "test_llm_proxy"})
            llm = proxy.as_resource(rollout.rollout_id, rollout.attempt.attempt_id)
            client = AsyncOpenAI(base_url=llm.endpoint, api_key="dummy", max_retries=0)
            answer = await client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": "hi"}])
        finally:
            await proxy.stop()
    assert answer.choices[0].message.content == "Hello!" and app.state.requests[0]["model"] == "served"
    assert app.state.requests[0]["return_token_ids"] is True  # asked for, as agl's return_token_ids callback does
    ids = {"rollout_id": rollout.rollout_id, "attempt_id": rollout.attempt.attempt_id}
    await store.add_span(reward_span(99, "r", 1.0, 1e10).model_copy(update=ids))  # as the agent's emit_reward would
    spans = list(await store.query_spans(rollout.rollout_id))
    (triplet,) = LlmProxyTraceToTriplet().adapt(spans)
    assert (triplet.prompt, triplet.response, triplet.reward) == ({"token_ids": [1, 2, 3]}, {"token_ids": [4, 5]}, 1.0)
    assert not proxy.is_running()
    with pytest.raises(ValueError, match="one proxy here serves one model"):
        agl.LLMProxy(
            model_list=[*model_list, {"model_name": "other", "litellm_params": model_list[0]["litellm_params"]}]
        )
    with pytest.raises(TypeError, match="llm_proxy= goes to a custom Algorithm"):
        agl.Trainer(llm_proxy=proxy)
    await store.close()
