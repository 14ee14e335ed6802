"""A training script of our own in the shape of agent-lightning 0.3's examples/calc_x/train_calc_agent.py, written
against `lightning` as an agl user's script reads after changing its import lines: a verl config dict given to
`agl.VERL`, `LightningEnvVar` / `resolve_*_env_var`, `--external-store-address` with `AGL_MANAGED_STORE=0` and
`agl.LightningStoreClient`, `--llm-proxy` with `tracer=agl.OtelTracer()` and `adapter=agl.LlmProxyTraceToTriplet()`,
and `trainer.fit(agent, train, val_dataset=val)`. `--torch` is the one change a CPU machine needs
(`VERL(config, trainer_backend="torch")`); without it, on a machine without CUDA, fit stops in one line saying so.

The agent is a calculator of ours: one call through its `llm` resource, the reward emitted."""

from __future__ import annotations

import argparse
import os
from typing import Any, TypedDict, cast

from openai import AsyncOpenAI

import lightning as agl
from lightning.env_var import LightningEnvVar, resolve_bool_env_var, resolve_str_env_var


class MathProblem(TypedDict):
    id: str
    question: str
    result: str


@agl.rollout
async def calc_agent(task: MathProblem, llm: agl.LLM) -> None:
    client = AsyncOpenAI(base_url=llm.endpoint, api_key="token-abc123", max_retries=0)
    answer = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": f"{task['question']} ="}], **llm.sampling_parameters
    )
    agl.emit_reward(1.0 if task["result"] in (answer.choices[0].message.content or "") else 0.0)


def math_problems(n: int) -> list[MathProblem]:
    return [{"id": str(i), "question": f"{i} + {i}", "result": str(2 * i)} for i in range(n)]


def verl_default_config() -> dict[str, Any]:
    return {
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "data": {"train_batch_size": 32, "max_prompt_length": 4096, "max_response_length": 2048},
        "actor_rollout_ref": {
            "rollout": {"tensor_model_parallel_size": 1, "n": 4, "name": "vllm", "gpu_memory_utilization": 0.6},
            "actor": {
                "ppo_mini_batch_size": 32,
                "ppo_micro_batch_size_per_gpu": 4,
                "optim": {"lr": 1e-6},
                "use_kl_loss": False,
                "kl_loss_coef": 0.0,
                "entropy_coeff": 0,
                "clip_ratio_low": 0.2,
                "clip_ratio_high": 0.3,
                "fsdp_config": {"param_offload": True, "optimizer_offload": True},
            },
            "model": {
                "path": "Qwen/Qwen2.5-1.5B-Instruct",
                "use_remove_padding": True,
                "enable_gradient_checkpointing": True,
            },
        },
        "trainer": {
            "n_gpus_per_node": 1,
            "logger": ["console"],
            "project_name": "AgentLightning",
            "experiment_name": "calc_x",
            "nnodes": 1,
            "test_freq": 32,
            "total_epochs": 2,
        },
    }


def train(
    *, model: str | None, llm_proxy: bool, ci_fast: bool, n_runners: int, external_store_address: str, torch: bool
) -> Any:
    train_dataset = cast(agl.Dataset[MathProblem], math_problems(8))
    val_dataset = cast(agl.Dataset[MathProblem], math_problems(2))
    config = verl_default_config()
    if model:
        config["actor_rollout_ref"]["model"]["path"] = model
    if ci_fast:
        if resolve_str_env_var(LightningEnvVar.AGL_CURRENT_ROLE) != "runner":
            print("PROJECT_NAME=AgentLightningCI")
        config["data"].update(train_batch_size=4, max_prompt_length=64, max_response_length=2)
        config["actor_rollout_ref"]["rollout"]["n"] = 2
        config["actor_rollout_ref"]["actor"].update(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=8)
        config["trainer"].update(total_training_steps=1, test_freq=1, experiment_name="calc_x_ci")

    algorithm = agl.VERL(config, trainer_backend="torch") if torch else agl.VERL(config)
    store: agl.LightningStore | None = None
    if external_store_address:
        store = agl.LightningStoreClient(external_store_address)
    if llm_proxy:
        tracer = agl.OtelTracer()
        adapter = agl.LlmProxyTraceToTriplet()
        trainer = agl.Trainer(algorithm=algorithm, n_runners=n_runners, store=store, tracer=tracer, adapter=adapter)
    else:
        trainer = agl.Trainer(algorithm=algorithm, n_runners=n_runners, store=store)
    return trainer.fit(calc_agent, train_dataset, val_dataset=val_dataset)


def main(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description="Train a math calc agent (agl's train_calc_agent.py shape).")
    parser.add_argument("--model", type=str, default=None)
    parser.add_argument("--llm-proxy", action="store_true")
    parser.add_argument("--ci-fast", action="store_true")
    parser.add_argument("--n-runners", type=int, default=2)
    parser.add_argument("--external-store-address", type=str, default="")
    parser.add_argument("--torch", action="store_true", help="VERL(config, trainer_backend='torch'): a CPU run")
    args = parser.parse_args(argv)
    if args.external_store_address and resolve_bool_env_var(LightningEnvVar.AGL_MANAGED_STORE, fallback=True):
        raise ValueError("When using an external store, please set the environment variable AGL_MANAGED_STORE=0.")
    agl.setup_logging("INFO")
    print("AGL_CURRENT_ROLE:", os.environ.get("AGL_CURRENT_ROLE"))
    return train(
        model=args.model,
        llm_proxy=args.llm_proxy,
        ci_fast=args.ci_fast,
        n_runners=args.n_runners,
        external_store_address=args.external_store_address,
        torch=args.torch,
    )


if __name__ == "__main__":
    main()
