"""The trainer's log-probs are the sampling policy's: softmax(logits / T) at the temperature T the rollouts were drawn
at (verl's actor does the same), on the padded and the lean paths, and a run passes its `sampling.temperature`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_lean_update import mixed_batch

from lightning.algorithm.losses import log_probs_from_hidden, token_log_probs
from lightning.algorithm.trainer import TorchTrainer, TrainerConfig
from lightning.config import load_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py, as tiny_dir

BASE = {"agent": "examples.copy_task.agent:copy_agent", "train_data": "examples.copy_task.data:train_tasks"}
"""The least a run's config needs."""


def test_log_probs_at_a_temperature_by_hand() -> None:
    # logits [2, 0], T = 2: z / T = [1, 0], log p(token 0) = 1 - log(e + 1) = -0.31326, log p(1) = -1.31326.
    hidden = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    weight = torch.tensor([[2.0, 0.0], [0.0, 0.0]])  # logits = hidden @ weight.T = [2, 0] per row
    log_probs, entropy = log_probs_from_hidden(hidden, weight, torch.tensor([0, 1]), temperature=2.0)
    expected = [1 - math.log(math.e + 1), -math.log(math.e + 1)]
    torch.testing.assert_close(log_probs, torch.tensor(expected))
    p = math.e / (math.e + 1)
    torch.testing.assert_close(entropy, torch.full((2,), -(p * math.log(p) + (1 - p) * math.log(1 - p))))
    at_one, _ = log_probs_from_hidden(hidden, weight, torch.tensor([0, 1]))
    torch.testing.assert_close(at_one, token_log_probs(torch.tensor([[2.0, 0.0]] * 2), torch.tensor([0, 1])))


@pytest.mark.parametrize("lean", [False, True], ids=["padded", "lean"])
def test_the_trainer_scores_responses_at_its_temperature(tiny_dir: Path, lean: bool) -> None:
    batch = mixed_batch()
    paths = {"pack_sequences": True, "logit_chunk_tokens": 4} if lean else {}
    plain = TorchTrainer(tiny_dir, TrainerConfig(), device="cpu")
    cold = TorchTrainer(tiny_dir, TrainerConfig(**paths), device="cpu")
    hot = TorchTrainer(tiny_dir, TrainerConfig(temperature=1.5, **paths), device="cpu")
    with torch.no_grad():
        logits = plain.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            position_ids=batch["position_ids"]).logits  # fmt: skip
    response_length = batch["responses"].shape[1]
    by_hand = token_log_probs(logits[:, -response_length - 1 : -1] / 1.5, batch["responses"])
    real = batch["attention_mask"][:, batch.prompt_length :].bool()
    torch.testing.assert_close(hot.log_probs(hot.model, batch)[real], by_hand[real], atol=1e-5, rtol=0)
    assert not torch.allclose(cold.log_probs(cold.model, batch)[real], by_hand[real], atol=1e-3)


def test_a_run_trains_at_its_sampling_temperature_unless_the_algorithm_names_one() -> None:
    assert load_config({**BASE, "sampling": {"temperature": 1.2}}).update_config.temperature == 1.2
    assert load_config({**BASE, "sampling": {"max_tokens": 8}}).update_config.temperature == 1.0  # OpenAI's default
    assert load_config({**BASE, "sampling": {"temperature": 0}}).update_config.temperature == 1.0  # greedy
    chosen = {**BASE, "sampling": {"temperature": 1.2}, "algorithm": {"temperature": 1.0}}
    assert load_config(chosen).update_config.temperature == 1.0


def test_the_sampler_log_probs_and_another_temperature_are_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"algorithm.temperature: .* at 1.2; sample at temperature 1.0, or use"):
        load_config({**BASE, "sampling": {"temperature": 1.2}, "algorithm": {"off_policy_correction": "tis"}})
    with pytest.raises(ValueError, match="algorithm.temperature"):
        load_config({**BASE, "sampling": {"temperature": 0.7}, "algorithm": {"old_log_probs": "sampler"}})
    load_config({**BASE, "sampling": {"temperature": 1.0}, "algorithm": {"off_policy_correction": "tis"}})
