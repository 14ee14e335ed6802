"""Train the SQL agent with agent-lightning's Trainer API on this project's `train` flow:

    python -m examples.agl_sql_agent.train                       # the tiny local model: checks the plumbing
    python -m examples.agl_sql_agent.train model=/path/to/hf-model inference.backend=vllm

The tiny model never writes a working query; a real instruct model (a Qwen2.5-Coder, say) earns reward from the
first iteration. `field=value` arguments set TrainConfig fields (dotted for nested ones).
"""

from __future__ import annotations

from typing import Any

import lightning as agl
from examples.agl_common import TINY_RUN, train_main
from examples.agl_sql_agent.agent import LitSqlAgent, train_tasks, val_tasks

DEFAULTS: dict[str, Any] = {**TINY_RUN, "run_name": "agl-sql-agent", "max_prompt_length": 512}


def train(**config: Any) -> dict[str, Any]:
    trainer = agl.Trainer(n_runners=2, algorithm={"lr": 1e-5, "kl_coef": 0.0}, **{**DEFAULTS, **config})
    return trainer.fit(LitSqlAgent(trained_agents=r"write"), train_tasks(), val_dataset=val_tasks())


def main(argv: list[str] | None = None) -> None:
    train_main(train, DEFAULTS, argv)


if __name__ == "__main__":
    main()
