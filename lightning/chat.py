"""Token-exact multi-turn conversations: the ids a chat template puts between a model's response and its next turn.

Turn k+1's prompt must begin with exactly turn k's prompt and response ids, or a trajectory row cannot join the
turns: a response decoded and rendered again by the template is not always the same ids (the model may have
sampled a split that the tokenizer would not make, and a template may reformat or strip the assistant's text). So
the next prompt is built as `prompt + response + bridge`, where only the bridge is rendered and encoded: the
template's end of the assistant turn after the model's last token, then the new messages (tool results, user text)
and the header of the next assistant turn. The LLM proxy does this for each call that continues an earlier one of
its attempt; warm-start demonstrations build their rows the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class NotAContinuation(Exception):
    """The new messages cannot be appended token-exactly; the message says why (it is counted as the reason)."""


class PromptTooLong(ValueError):
    """A prompt longer than the model's context, found without tokenizing the whole of it (`check_fits`)."""


PREFIX_CHARS_PER_TOKEN = 8
"""check_fits's first prefix of a long prompt: this many characters per token of the context (text averages about
4; a prefix this long that stays within the context is rare, and the next is 4 times longer)."""


class TextCodec:
    """`encode(text)` and `decode(ids)` as a transformers tokenizer gives them (`tokenizer.encode(text,
    add_special_tokens=False)`, `tokenizer.decode(ids, skip_special_tokens=True)`), through the Rust tokenizer behind
    a fast one directly: the inference server decodes every row at every generated token, and the wrapper made a
    24-token decode 2.6 times as costly (docs/benchmarks.md, "The rollout path's CPU"; encoding costs about the same).
    A slow tokenizer, or a fast one whose decode tidies spaces afterwards (`clean_up_tokenization_spaces`), goes
    through the wrapper. One codec to a tokenizer, used from one thread at a time: a Rust tokenizer used from two at
    once can fail ("Already borrowed")."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
        if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", False):
            backend = None
        if backend is not None:  # as the wrapper sets them for a call without truncation or padding
            backend.no_truncation()
            backend.no_padding()
            backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
        self.backend = backend

    def encode(self, text: str) -> list[int]:
        if self.backend is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        if self.backend is None:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.backend.decode(ids, skip_special_tokens=True)


def longest_token_chars(tokenizer: Any) -> int:
    """The longest token's text as the vocabulary spells it, which is never shorter than the text it stands for: a
    text of n characters is at least n / this many tokens."""
    return max(1, max(map(len, tokenizer.get_vocab())))


def check_fits(tokenizer: Any, text: str, context_length: int, max_token_chars: int) -> None:
    """Raise PromptTooLong if `text` cannot fit `context_length` tokens, without tokenizing the whole of it (a 5 MB
    prompt took seconds and a gigabyte to tokenize).

    First by its length: a token covers at most `max_token_chars` characters (`longest_token_chars`), so a text
    longer than context x that is over it for sure. A real vocabulary's longest token is long (128 characters in
    GPT-4's, Qwen's and Llama 3's), which lets megabytes past that bound on a 32k-token model; so then by a prefix:
    the tokens of a prefix that ends before a space between two non-spaces are as many as the text's own up to there
    (no token of a byte-level BPE, SentencePiece or WordPiece vocabulary spans such a space: each word is tokenized
    apart), so a prefix that fills the context alone is enough. Prefixes grow 4 times at a time, from
    PREFIX_CHARS_PER_TOKEN characters a token of the context; a text with no such space is left to be tokenized
    whole."""
    at_least = -(-len(text) // max_token_chars)
    if at_least > context_length:
        raise PromptTooLong(
            f"the prompt is {len(text):,} characters, at least {at_least:,} tokens, but the model's context is "
            f"{context_length}; shorten the prompt"
        )
    end = (context_length + 1) * PREFIX_CHARS_PER_TOKEN
    while end < len(text):
        cut = _space_between_words(text, end)
        if cut is None:
            return
        count = len(tokenizer.encode(text[:cut], add_special_tokens=False))
        if count >= context_length:
            raise PromptTooLong(
                f"the prompt is {len(text):,} characters, and its first {cut:,} alone are {count:,} tokens, but the "
                f"model's context is {context_length}; shorten the prompt"
            )
        end *= 4


def _space_between_words(text: str, end: int, tries: int = 100) -> int | None:
    """The index of the last space before `end` that stands between two non-space characters (`end` < len(text)),
    among the last `tries` spaces; None if there is none."""
    at = text.rfind(" ", 1, end)
    for _ in range(tries):
        if at < 1:
            return None
        if not text[at - 1].isspace() and not text[at + 1].isspace():
            return at
        at = text.rfind(" ", 1, at)
    return None


def render_ids(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    tools: Any = None,
    add_generation_prompt: bool,
    fits: tuple[int, int] | None = None,
) -> list[int]:
    """`messages` through the tokenizer's chat template, encoded (no special tokens added beyond the template's).
    With `fits` (the context length and the longest token's characters), a text too long for the context raises
    PromptTooLong before it is tokenized whole (`check_fits`)."""
    text = tokenizer.apply_chat_template(
        list(messages), tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    if fits is not None:
        check_fits(tokenizer, text, *fits)
    return tokenizer.encode(text, add_special_tokens=False)


def continue_conversation(
    tokenizer: Any,
    history: Sequence[dict[str, Any]],
    new_messages: Sequence[dict[str, Any]],
    *,
    tools: Any = None,
    last: int,
    fits: tuple[int, int] | None = None,
) -> list[int]:
    """The bridge ids after a response whose last token is `last`: `history` ends with that response as an
    assistant message, `new_messages` follow it, and the bridge ends with the next assistant turn's header.

    Raises NotAContinuation when the response did not end its turn (`last` is not a special token: the response was
    cut off, and where the template would close it is unknown), or when the template renders `history` differently
    once more messages follow it. With `fits` (as `render_ids` takes it), a conversation too long for the context
    raises PromptTooLong before it is tokenized whole."""
    if last not in set(tokenizer.all_special_ids):
        raise NotAContinuation("the previous response did not end its turn (cut off by max_tokens?)")
    full = render_ids(tokenizer, [*history, *new_messages], tools=tools, add_generation_prompt=True, fits=fits)
    base = render_ids(tokenizer, history, tools=tools, add_generation_prompt=False)
    if full[: len(base)] != base:
        raise NotAContinuation("the chat template renders the conversation so far differently once new messages follow")
    try:
        end = len(base) - 1 - base[::-1].index(last)
    except ValueError:
        raise NotAContinuation("the chat template does not end the assistant's turn with its end token") from None
    return base[end + 1 :] + full[len(base) :]
