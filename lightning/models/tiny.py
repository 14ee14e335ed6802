"""Build a tiny random-weight causal LM with a real tokenizer and chat template, for tests and CPU dry runs."""

from __future__ import annotations

import errno
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from lightning.diskspace import NoSpaceLeft
from lightning.models.files import make_tokenizer_config_portable, no_progress_bars

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]

# ChatML, as Qwen and many open models use it; tool calls and tool specs are rendered as JSON so an agent's
# tool-calling conversation tokenizes the same way every time.
CHAT_TEMPLATE = (
    "{% set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    # vLLM gives a template that reads content parts every message's content as parts, the system message's too (the
    # newlines as an expression: a newline right after a block tag is trimmed).
    "{% if system is string %}{{ system }}\n\n"
    "{% elif system %}{% for part in system if part['type'] == 'text' %}{{ part['text'] }}{% endfor %}"
    "{{ '\\n\\n' }}{% endif %}"
    "You can call these tools. To call one, answer with "
    '<tool_call>{"name": <name>, "arguments": <arguments>}</tool_call>.\n'
    "<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools><|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}"
    "{% for part in message['content'] if part['type'] == 'text' %}{{ part['text'] }}{% endfor %}"
    "{% endif %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{% set arguments = call['function']['arguments'] %}"
    "{% if not loop.first or message['content'] %}\n{% endif %}"
    '<tool_call>{"name": {{ call["function"]["name"] | tojson }}, "arguments": '
    "{{ arguments if arguments is string else arguments | tojson }}}</tool_call>"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Enough text for BPE to learn common English and arithmetic merges; the byte alphabet makes any text encodable.
CORPUS = [
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ \t\n",
    "The quick brown fox jumps over the lazy dog. The answer is 42.",
    "What is 12 + 7? The answer is 19. What is 6 * 7? It is 42. 100 - 58 = 42. 3 / 4 = 0.75",
    "You are a helpful assistant. Please answer the question, then stop.",
    "I think the result of the calculation is correct, so the final answer is below.",
    "user assistant system tool call function arguments name content role",
    '{"name": "calculator", "arguments": {"expression": "2 + 2"}}',
    "Hello, world! How are you today? I am fine, thank you. Let me check that for you.",
]


def build_tokenizer(vocab_size: int = 384, extra_corpus: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on CORPUS and `extra_corpus` (256 byte tokens, merges, then the special
    tokens). Text in `extra_corpus` gets merges of its own, at the expense of CORPUS's rarest."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([*CORPUS, *extra_corpus] * 20, trainer=trainer)
    # Added after training so the special tokens take the last ids and never take part in merges.
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )


def build_tiny_model(
    path: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    max_positions: int = 512,
    vocab_size: int = 384,
    extra_corpus: Sequence[str] = (),
    init_std: float = 0.2,
) -> Path:
    """Write a random-init Llama model and its tokenizer to `path` as a Hugging Face directory; returns the path.

    The same seed gives the same weights and tokenizer. Transformers and vLLM load the directory as is.
    """
    path = Path(path)
    tokenizer = build_tokenizer(vocab_size, extra_corpus)
    tokenizer.model_max_length = max_positions
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        # Untied: vLLM 0.32's in-place reload_weights left a tied output layer on the old weights (measured: log-probs
        # off by 3 nats after a reload; untied, 3e-6).
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=[im_end_id, eos_id],
        pad_token_id=eos_id,
        # By default larger than Llama's 0.02 so a random model's next-token distribution is not flat: greedy and
        # sampled outputs then differ in ways tests can see.
        initializer_range=init_std,
        torch_dtype="float32",
    )
    # A private generator state: building a model must not change the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=[im_end_id, eos_id], pad_token_id=eos_id, do_sample=True
    )
    path.mkdir(parents=True, exist_ok=True)
    try:
        with no_progress_bars():
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
    except Exception as exc:  # safetensors says a full disk as "os error 28", without the path
        if getattr(exc, "errno", None) == errno.ENOSPC or "os error 28" in str(exc):
            size = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
            raise NoSpaceLeft(
                f"no space left on {path}: the tiny model's {size / 2**20:.1f} MB could not be written ({exc}); free "
                "space there, then run the same command again"
            ) from exc
        raise
    make_tokenizer_config_portable(path / "tokenizer_config.json")
    return path
