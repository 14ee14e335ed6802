"""The tiny model: a Hugging Face directory that transformers loads as is, with a lossless tokenizer."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning.models import build_tiny_model
from lightning.models.__main__ import main as models_main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_dir)


def test_directory_loads_with_from_pretrained(tiny_dir: Path, tokenizer) -> None:
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (tiny_dir / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.config.model_type == "llama"
    # What vLLM's CPU build serves and reloads: attention heads of 32 (it refuses 16), an untied output layer (its
    # in-place reload left a tied one on the old weights).
    assert model.config.head_dim >= 32 and not model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tokenizer)
    im_end, eos = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert set(model.generation_config.eos_token_id) == {im_end, eos}
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    with torch.inference_mode():
        logits = model(torch.tensor([tokenizer.encode("1 + 1 =")])).logits
    assert logits.shape[-1] == len(tokenizer)
    assert torch.isfinite(logits).all()
    # transformers 4 (which vLLM may pin) cannot read transformers 5's tokenizer class name.
    assert json.loads((tiny_dir / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_any_ascii_text_round_trips(tokenizer) -> None:
    rng = random.Random(0)
    alphabet = string.printable
    samples = [alphabet, "What is 12 + 7? The answer is 19.", "  two  spaces\n\ttab", "", "naïve café ✓ 😀"]
    samples += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(200)]
    for text in samples:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    # Merges were learned: common text takes fewer tokens than bytes.
    assert len(tokenizer.encode("The answer is 42.", add_special_tokens=False)) < len("The answer is 42.")


def test_special_tokens_are_single_tokens(tokenizer) -> None:
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_chat_template(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "2+2"}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
        {"role": "assistant", "content": "It is 4."},
    ]
    assert tokenizer.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "calc", "arguments": {"e": "2+2"}}</tool_call><|im_end|>\n'
        "<|im_start|>tool\n4<|im_end|>\n"
        "<|im_start|>assistant\nIt is 4.<|im_end|>\n"
    )
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    with_tools = tokenizer.apply_chat_template(messages[:2], tools=tools, tokenize=False, add_generation_prompt=True)
    assert with_tools.startswith("<|im_start|>system\nBe brief.\n\nYou can call these tools.")
    assert json.dumps(tools[0]) in with_tools
    assert with_tools.count("Be brief.") == 1
    assert with_tools.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    # Arguments given as a dict are rendered as JSON too.
    as_dict = [{**messages[2], "tool_calls": [{"function": {"name": "calc", "arguments": {"e": "2+2"}}}]}]
    assert '"arguments": {"e": "2+2"}' in tokenizer.apply_chat_template(as_dict, tokenize=False)


def test_same_seed_same_model(tmp_path: Path, tiny_dir: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    other = build_tiny_model(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()


def test_build_does_not_touch_global_rng(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)


def test_cli_build_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    models_main(["build-tiny", str(tmp_path / "cli"), "--hidden-size", "32", "--num-layers", "1"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (32, 1)


def test_a_full_disk_names_the_path_and_the_size(tmp_path: Path) -> None:
    """A full disk while the tiny model is written (its tokenizer file points at /dev/full, which answers every
    write with ENOSPC) is a NoSpaceLeft naming the directory and the size, not a bare "os error 28"."""
    from lightning.diskspace import NoSpaceLeft

    target = tmp_path / "model"
    target.mkdir()
    (target / "tokenizer.json").symlink_to("/dev/full")
    with pytest.raises(NoSpaceLeft, match=rf"no space left on {target}: the tiny model's [\d.]+ MB could not be"):
        build_tiny_model(target)


def test_an_extra_corpus_gets_merges_of_its_own_and_none_leaves_the_tokenizer_as_it_was() -> None:
    from lightning.models.tiny import build_tokenizer

    call = '<tool_call>{"name": "lookup", "arguments": {"key": "md"}}</tool_call>'
    plain = build_tokenizer()
    assert plain.get_vocab() == build_tokenizer(extra_corpus=()).get_vocab()
    tooled = build_tokenizer(extra_corpus=[call] * 3)
    assert len(tooled.encode(call)) < len(plain.encode(call)) and len(tooled) == len(plain)
    assert tooled.decode(tooled.encode(call)) == call


def test_a_run_builds_the_tiny_model_its_config_asks_for(tmp_path: Path) -> None:
    from transformers import AutoConfig

    from lightning.config import load_config
    from lightning.run import prepare_model

    call = '<tool_call>{"name": "lookup", "arguments": {"key": "m"}}</tool_call>'
    config = load_config({
        "agent": "examples.lookup.agent:lookup_agent", "output_dir": str(tmp_path),
        "tiny_model": {"hidden_size": 32, "num_layers": 1, "tokenizer_corpus": [call] * 3, "init_std": 0.02},
    })  # fmt: skip
    config.run_dir.mkdir(parents=True)
    path = prepare_model(config)
    built = AutoConfig.from_pretrained(path)
    assert (built.hidden_size, built.num_hidden_layers, built.initializer_range) == (32, 1, 0.02)
    weights = AutoModelForCausalLM.from_pretrained(path).model.embed_tokens.weight
    assert 0.015 < weights.std().item() < 0.025  # drawn with that spread (the default, 0.2, is ten times as wide)
    assert len(AutoTokenizer.from_pretrained(path).encode(call)) < 30  # 44 with the default tokenizer
    with pytest.raises(ValueError, match="tiny_model.hidden_sizes"):
        load_config({"tiny_model": {"hidden_sizes": 32}})
