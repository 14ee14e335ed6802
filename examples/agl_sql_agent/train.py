"""Train the SQL agent with agent-lightning's Trainer API on this project's `train` flow:

    python -m examples.agl_sql_agent.train                       # the tiny local model: checks the plumbing
    python -m examples.agl_sql_agent.train model=/path/to/hf-model inference.backend=vllm

The tiny model never writes a working query; a real instruct model (a Qwen2.5-Coder, say) earns reward from the
first iteration. `field=value` arguments set TrainConfig fields (dotted for nested ones).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import lightning as agl
from examples.agl_sql_agent.agent import LitSqlAgent, train_tasks, val_tasks
from lightning.config_file import apply_overrides, parse_overrides

DEFAULTS: dict[str, Any] = {
    "run_name": "agl-sql-agent",
    "model": "tiny",
    "iterations": 3,
    "batch_size": 8,
    "samples_per_task": 4,
    "sampling": {"temperature": 1.0, "max_tokens": 96},
    "eval_sampling": {"temperature": 0.0, "max_tokens": 96},
    "max_prompt_length": 512,
    "max_response_length": 96,
}


def train(**config: Any) -> dict[str, Any]:
    trainer = agl.Trainer(n_runners=2, algorithm={"lr": 1e-5, "kl_coef": 0.0}, **{**DEFAULTS, **config})
    return trainer.fit(LitSqlAgent(trained_agents=r"write"), train_tasks(), val_dataset=val_tasks())


def main(argv: list[str] | None = None) -> None:
    agl.setup_logging()
    config = apply_overrides(DEFAULTS, parse_overrides(sys.argv[1:] if argv is None else argv))
    print(json.dumps(train(**config), indent=2, default=str))


if __name__ == "__main__":
    main()
