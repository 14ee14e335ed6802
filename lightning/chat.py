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


def render_ids(
    tokenizer: Any, messages: Sequence[dict[str, Any]], *, tools: Any = None, add_generation_prompt: bool
) -> list[int]:
    """`messages` through the tokenizer's chat template, encoded (no special tokens added beyond the template's)."""
    text = tokenizer.apply_chat_template(
        list(messages), tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def continue_conversation(
    tokenizer: Any,
    history: Sequence[dict[str, Any]],
    new_messages: Sequence[dict[str, Any]],
    *,
    tools: Any = None,
    last: int,
) -> list[int]:
    """The bridge ids after a response whose last token is `last`: `history` ends with that response as an
    assistant message, `new_messages` follow it, and the bridge ends with the next assistant turn's header.

    Raises NotAContinuation when the response did not end its turn (`last` is not a special token: the response was
    cut off, and where the template would close it is unknown), or when the template renders `history` differently
    once more messages follow it."""
    if last not in set(tokenizer.all_special_ids):
        raise NotAContinuation("the previous response did not end its turn (cut off by max_tokens?)")
    base = render_ids(tokenizer, history, tools=tools, add_generation_prompt=False)
    full = render_ids(tokenizer, [*history, *new_messages], tools=tools, add_generation_prompt=True)
    if full[: len(base)] != base:
        raise NotAContinuation("the chat template renders the conversation so far differently once new messages follow")
    try:
        end = len(base) - 1 - base[::-1].index(last)
    except ValueError:
        raise NotAContinuation("the chat template does not end the assistant's turn with its end token") from None
    return base[end + 1 :] + full[len(base) :]
