"""LoRA training (algorithm.lora) on the CPU and the tiny model: only the adapters train, the KL reference is the base
with the adapters off, a checkpoint holds the adapter and resumes the same next update, and the embedded inference
server serves an adapter published to it as peft's merged model computes it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import safetensors.torch
import torch
from pydantic import ValidationError
from support.servers import serving

from lightning.algorithm.batch import TrainingBatch
from lightning.algorithm.config import LoraConfig
from lightning.algorithm.trainer import TorchTrainer, TrainerConfig, load_policy
from lightning.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verified_latest_checkpoint,
    verify_checkpoint,
)
from lightning.config import ConfigError, load_config
from lightning.types import Triplet

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py, as tiny_dir

LORA = {"rank": 4, "alpha": 8}
BASE = {"lr": 1e-2, "micro_batch_size": 2, "use_kl_loss": True, "kl_coef": 0.1, "lora": LORA}


def batch_of(seed: int, rows: int = 6) -> TrainingBatch:
    """Rows of prompt lengths 2..6 and response lengths 1..7, three groups, random rewards."""
    generator = torch.Generator().manual_seed(seed)
    triplets = []
    for row in range(rows):
        prompt = torch.randint(0, 380, (2 + (row * 3) % 5,), generator=generator).tolist()
        response = torch.randint(0, 380, (1 + (row * 5) % 7,), generator=generator).tolist()
        reward = float(torch.rand(1, generator=generator))
        triplets.append(Triplet(prompt=prompt, response=response, reward=reward, metadata={"group_id": row % 3}))
    return TrainingBatch.from_triplets(triplets, pad_token_id=0, max_prompt_length=8, max_response_length=8)


def adapter_state(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters() if "lora_" in name}


# --- the config ----------------------------------------------------------------------------------


def test_lora_is_off_by_default_and_a_bad_value_names_its_field() -> None:
    assert TrainerConfig().lora is None
    assert TrainerConfig(lora={}).lora == LoraConfig()
    for bad, field in (({"rank": 0}, "rank"), ({"dropout": 1.0}, "dropout"), ({"target_modules": []}, "target")):
        with pytest.raises(ValidationError, match=f"lora.{field}"):
            TrainerConfig(lora=bad)
    with pytest.raises(ValidationError, match="lora.ranks"):
        TrainerConfig(lora={"ranks": 4})


def test_an_override_turns_lora_on_and_a_bad_one_says_which(tmp_path: Path) -> None:
    base = {"agent": "examples.copy_task.agent:copy_agent", "output_dir": str(tmp_path)}
    config = load_config(base, **{"algorithm.lora.rank": 8})
    assert config.algorithm.lora == LoraConfig(rank=8)
    # Overriding a dumped config, whose lora is null, works the same.
    assert load_config(config.model_dump(), **{"algorithm.lora.alpha": 4}).algorithm.lora.alpha == 4
    with pytest.raises(ConfigError, match=r"algorithm\.lora\.rank: .* \(set by the override algorithm\.lora\.rank\)"):
        load_config(base, **{"algorithm.lora.rank": -1})


# --- the update ----------------------------------------------------------------------------------


def test_only_the_adapters_train_and_the_reference_is_the_base(tiny_dir: Path) -> None:
    trainer = TorchTrainer(tiny_dir, TrainerConfig(**BASE), device="cpu")
    base = load_policy(tiny_dir)[0].eval()
    assert trainer.reference is None  # no second copy of the model
    optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    adapters = [p for name, p in trainer.model.named_parameters() if "lora_" in name]
    assert len(optimized) == len(adapters) > 0 and all(any(p is a for a in adapters) for p in optimized)
    assert sum(p.numel() for p in optimized) < 0.2 * sum(p.numel() for p in base.parameters())
    frozen_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}

    for seed in range(3):
        metrics = trainer.step(batch_of(seed))
    assert metrics["kl_loss"] > 0  # the adapters moved the policy away from the base
    for name, p in trainer.model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, frozen_before[name]), name
    batch = batch_of(7)
    expected = trainer.log_probs(base, batch)
    torch.testing.assert_close(trainer.reference_log_probs(batch), expected, atol=1e-6, rtol=0)
    assert not torch.allclose(trainer.log_probs(trainer.model, batch), expected, atol=1e-3)
    assert trainer.state_dict()["optimizer"]["state"].keys() == set(range(len(adapters)))


def test_the_lora_update_is_the_same_with_micro_batches_and_gradient_checkpointing(tiny_dir: Path) -> None:
    results = []
    for changes in ({"micro_batch_size": 6}, {"micro_batch_size": 1, "gradient_checkpointing": True}):
        trainer = TorchTrainer(tiny_dir, TrainerConfig(**{**BASE, **changes}), device="cpu")
        for seed in range(2):
            metrics = trainer.step(batch_of(seed))
        results.append((adapter_state(trainer), metrics))
    (first, first_metrics), (second, second_metrics) = results
    for name in first:
        torch.testing.assert_close(first[name], second[name], atol=1e-5, rtol=1e-4)
    assert first_metrics["loss"] == pytest.approx(second_metrics["loss"], rel=1e-4, abs=1e-6)


# --- checkpoints ---------------------------------------------------------------------------------


def test_a_lora_checkpoint_holds_the_adapter_and_resumes_the_same_next_update(tiny_dir: Path, tmp_path: Path) -> None:
    from lightning.algorithm.worker import _load_trainer

    root = tmp_path / "checkpoints"
    config = TrainerConfig(**BASE)
    first = TorchTrainer(tiny_dir, config, device="cpu")
    first.step(batch_of(0))
    first.step(batch_of(1))
    path = save_checkpoint(root, 2, first.model, first.tokenizer, trainer_state=first.state_dict())
    expected = first.step(batch_of(2))

    names = {p.name for p in path.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer_config.json"} <= names
    assert "model.safetensors" not in names and "config.json" not in names
    checkpoint = load_checkpoint(path)
    assert checkpoint.base_model == tiny_dir.resolve()
    assert json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_dir.resolve())
    verify_checkpoint(path)
    assert (path / "adapter_model.safetensors").stat().st_size < 0.2 * (tiny_dir / "model.safetensors").stat().st_size

    # The trainer process's own resume: the base from the run's model, the adapter and optimizer from the checkpoint.
    resumed, step = _load_trainer(str(tiny_dir), config.model_dump(mode="json"), str(root), threads=1)
    assert step == 2
    again = resumed.step(batch_of(2))
    assert again["loss"] == expected["loss"] and again["grad_norm"] == expected["grad_norm"]
    mine, theirs = adapter_state(resumed), adapter_state(first)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name

    with pytest.raises(ValueError, match="holds a LoRA adapter and algorithm.lora is not"):
        _load_trainer(str(tiny_dir), TrainerConfig().model_dump(mode="json"), str(root), threads=1)


def test_a_damaged_adapter_checkpoint_is_set_aside(tiny_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    trainer = TorchTrainer(tiny_dir, TrainerConfig(**BASE), device="cpu")
    good = save_checkpoint(root, 1, trainer.model, trainer.tokenizer, trainer_state=trainer.state_dict())
    trainer.step(batch_of(0))
    bad = save_checkpoint(root, 2, trainer.model, trainer.tokenizer, trainer_state=trainer.state_dict())
    weights = bad / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert latest_checkpoint(root) == bad  # sizes match: only the checksums tell
    assert verified_latest_checkpoint(root) == good
    assert not bad.exists()


# --- publishing to the embedded inference server -------------------------------------------------


def merged_model(tiny_dir: Path, adapter_dir: Path) -> Any:
    from peft import PeftModel

    return PeftModel.from_pretrained(load_policy(tiny_dir)[0], str(adapter_dir)).merge_and_unload().eval()


def completion_logprobs(base_url: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    response = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=1, extra_body={"return_token_ids": True}
    )
    choice = response.choices[0]
    return choice.model_extra["token_ids"], choice.logprobs.token_logprobs


def forward_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> tuple[list[int], list[float]]:
    """The greedy tokens after `prompt` + `tokens[:i]` and the log-probs of `tokens`, by one forward pass."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    steps = torch.log_softmax(logits, -1)
    return steps.argmax(-1).tolist(), [float(steps[i, token]) for i, token in enumerate(tokens)]


@pytest.mark.parametrize("head", [False, True], ids=["default-targets", "with-lm_head"])
def test_a_published_adapter_is_served_as_the_merged_model_computes(tiny_dir: Path, tmp_path: Path, head: bool) -> None:
    from lightning.inference import create_inference_app

    root = tmp_path / "checkpoints"
    targets = [*LoraConfig().target_modules, "lm_head"] if head else LoraConfig().target_modules
    trainer = TorchTrainer(
        tiny_dir, TrainerConfig(**{**BASE, "lora": {**LORA, "target_modules": targets}}), device="cpu"
    )
    paths = []
    for seed in range(4):
        trainer.step(batch_of(seed))
        if seed in (1, 3):
            paths.append(save_checkpoint(root, seed + 1, trainer.model, trainer.tokenizer, trainer_state={}))
    saved = safetensors.torch.load_file(str(paths[0] / "adapter_model.safetensors"))
    assert saved and all(".lora_A." in key or ".lora_B." in key for key in saved), sorted(saved)[:4]  # no frozen head
    prompt = batch_of(9)["input_ids"][0, -4:].tolist()
    base = load_policy(tiny_dir)[0].eval()

    app = create_inference_app(tiny_dir, served_model_name="tiny", max_batch_size=4)
    with serving(app) as base_url:
        before, _ = completion_logprobs(base_url, prompt)
        for step, path in zip((2, 4), paths, strict=True):
            reloaded = httpx.post(f"{base_url}/admin/reload", json={"path": str(path), "version": step}, timeout=60)
            assert reloaded.json() == {"version": step, "path": str(path)}
            served = httpx.get(f"{base_url}/admin/version").json()
            assert served["version"] == step and served["base_model"] == str(tiny_dir.resolve())
            tokens, logprobs = completion_logprobs(base_url, prompt)
            # Each adapter merged into the base, not into the adapter before it: peft's merged model, token for token.
            greedy, expected = forward_logprobs(merged_model(tiny_dir, path), prompt, tokens)
            assert tokens == greedy
            assert logprobs == pytest.approx(expected, abs=1e-4)
            assert app.state.engine.recent[-1].model_version == step
        assert forward_logprobs(base, prompt, tokens)[1] != pytest.approx(logprobs, abs=1e-3)  # the adapter matters
        assert tokens != before or logprobs != pytest.approx(forward_logprobs(base, prompt, tokens)[1], abs=1e-3)

        # A whole model again: served as it is, and an adapter after it merges into its base, loaded afresh.
        assert httpx.post(f"{base_url}/admin/reload", json={"path": str(tiny_dir), "version": 5}).status_code == 200
        assert completion_logprobs(base_url, prompt)[0] == before
        missing = tmp_path / "orphan"
        missing.mkdir()
        (missing / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "nope")}))
        refused = httpx.post(f"{base_url}/admin/reload", json={"path": str(missing)})
        assert refused.status_code == 400 and "base_model_name_or_path" in refused.text

    # A server started on an adapter checkpoint (a restart, a resumed run) serves it merged too.
    restarted = create_inference_app(paths[1], served_model_name="tiny", max_batch_size=4)
    with serving(restarted) as base_url:
        served_tokens, served_logprobs = completion_logprobs(base_url, prompt)
        assert served_tokens == tokens and served_logprobs == pytest.approx(logprobs, abs=1e-5)


# --- export, registration, the other backends ----------------------------------------------------


def test_export_merges_an_adapter_into_a_whole_model_and_a_run_registers_it_merged(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    from lightning.cli import main
    from lightning.metrics import MlflowTracker

    trainer = TorchTrainer(tiny_dir, TrainerConfig(**BASE), device="cpu")
    for seed in range(2):
        trainer.step(batch_of(seed))
    path = save_checkpoint(tmp_path / "checkpoints", 2, trainer.model, trainer.tokenizer, trainer_state={})
    batch = batch_of(8)
    expected = trainer.log_probs(merged_model(tiny_dir, path), batch)
    torch.testing.assert_close(trainer.log_probs(trainer.model, batch), expected, atol=1e-5, rtol=0)

    assert main(["export", str(path), str(tmp_path / "merged")]) == 0
    assert "its LoRA adapter merged into its base" in capsys.readouterr().out
    exported = load_policy(tmp_path / "merged")
    assert exported[1] is not None  # the tokenizer came along
    torch.testing.assert_close(trainer.log_probs(exported[0].eval(), batch), expected, atol=1e-6, rtol=0)
    with pytest.raises(SystemExit):
        main(["export", str(path), str(tmp_path / "merged")])  # not over a model already there
    assert "not empty" in capsys.readouterr().err

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker(uri, run_name="r")
    tracker.start()
    version = tracker.register_model(path, "lora-policy")
    tracker.end()
    source = MlflowClient(uri, registry_uri=uri).get_model_version("lora-policy", str(version)).source
    assert source.endswith("checkpoints/step-000002-merged")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    registered = Path(download_artifacts(f"models:/lora-policy/{version}", dst_path=str(tmp_path / "download")))
    torch.testing.assert_close(trainer.log_probs(load_policy(registered)[0].eval(), batch), expected, atol=1e-6, rtol=0)


def test_verl_gets_the_lora_options_it_has(tmp_path: Path) -> None:
    from lightning.algorithm.config import VerlOptions
    from lightning.algorithm.verl_backend import verl_overrides

    overrides = verl_overrides(
        "m", TrainerConfig(lora={"rank": 8, "alpha": 16}), VerlOptions(), rows_per_step=8, total_steps=1
    )
    assert "actor_rollout_ref.model.lora_rank=8" in overrides
    assert "actor_rollout_ref.model.lora_alpha=16.0" in overrides
    assert any(o.startswith("actor_rollout_ref.model.target_modules=[q_proj,k_proj") for o in overrides)
    with pytest.raises(ValueError, match="algorithm.lora.dropout: verl's LoRA has no dropout"):
        verl_overrides("m", TrainerConfig(lora={"dropout": 0.1}), VerlOptions(), rows_per_step=8, total_steps=1)


def test_an_adapted_embedding_is_refused_naming_the_field(tiny_dir: Path, tmp_path: Path) -> None:
    """The servers merge (or vLLM loads) adapters of linear layers: an adapted embedding would be left out of what
    they serve, so the trainer refuses it at the start, not at the first publish."""
    config = TrainerConfig(**{**BASE, "lora": {**LORA, "target_modules": ["q_proj", "embed_tokens"]}})
    with pytest.raises(ValueError, match=r"lora.target_modules: \['embed_tokens'\] are embedding layers"):
        TorchTrainer(tiny_dir, config, device="cpu")
    # One made by peft directly is refused by the servers rather than served without its embedding.
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from lightning.inference.lora import adapter_factors

    adapted = get_peft_model(load_policy(tiny_dir)[0], PeftLoraConfig(r=4, target_modules=["q_proj", "embed_tokens"]))
    adapted.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"only adapters on linear layers are served here, not \['base_model"):
        adapter_factors(tmp_path / "adapter")


def test_lora_on_vllm_replicas_is_taken_and_what_they_cannot_serve_is_refused(tmp_path: Path) -> None:
    base = {"agent": "examples.copy_task.agent:copy_agent", "output_dir": str(tmp_path), "algorithm": {"lora": {}}}
    assert load_config(base, **{"inference.backend": "vllm"}).algorithm.lora.rank == 16
    refused = {
        "inference.vllm.max_lora_rank: 8 cannot serve adapters of rank 16": {"inference.vllm": {"max_lora_rank": 8}},
        "inference.vllm.max_lora_rank: 24 cannot": {"inference.vllm": {"max_lora_rank": 24}},  # not a rank vLLM takes
        "inference.vllm.enable_lora: a LoRA run's vLLM replicas serve its adapters": {
            "inference.vllm": {"enable_lora": False}
        },
        "algorithm.lora.rank: vLLM serves adapters of rank 512 at most": {"algorithm.lora.rank": 1024},
        "algorithm.lora: the run hot-swaps the torch trainer's LoRA checkpoints": {"trainer_backend": "verl"},
    }
    for message, overrides in refused.items():
        with pytest.raises(ConfigError, match=message):
            load_config(base, **{"inference.backend": "vllm", **overrides})
