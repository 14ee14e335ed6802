"""The LLM proxy's memory of each attempt's conversation, so that a call continuing an earlier one gets its prompt as
that call's exact prompt and response ids plus the new messages' ids (`lightning.chat`), not the whole conversation
rendered and encoded again."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.chat import NotAContinuation, PromptTooLong, continue_conversation, longest_token_chars
from lightning.proxy.capture import Call

MAX_ATTEMPTS = 20_000
"""Attempts remembered (the least recently called are forgotten first)."""
MAX_CALLS = 64
"""Calls remembered per attempt: a continuation is looked for among the latest ones."""


@dataclass
class _Answered:
    messages: list[dict[str, Any]]
    tools: Any
    prompt_ids: list[int]
    choices: list[tuple[dict[str, Any], list[int]]]
    """(the assistant message as answered, its response ids), per choice."""


@dataclass
class Continuation:
    """What the proxy found for a chat call: the prompt ids to send (None: let the server render the messages) and,
    when a call continued an earlier one but could not be joined token-exactly, why."""

    prompt_ids: list[int] | None = None
    continues: bool = False
    reason: str | None = None


class Conversations:
    """The answered chat calls of each attempt, and the prompt ids of a call that continues one of them."""

    def __init__(self, tokenizer: Any) -> None:
        """`tokenizer`: the policy's tokenizer, or its model directory, loaded when a call first continues another
        (a run whose agent makes one call at a time never loads it: importing transformers' AutoTokenizer, torch
        with it, is 2.5 s of a proxy's start)."""
        if isinstance(tokenizer, str | os.PathLike) and not (Path(tokenizer) / "tokenizer_config.json").is_file():
            raise ValueError(f"tokenizer {str(tokenizer)!r}: no tokenizer_config.json there; give a model directory")
        self._tokenizer = tokenizer
        self._context = _context_length(tokenizer)
        self._fits: tuple[int, int] | None = None
        self._loading = threading.Lock()
        self._calls: OrderedDict[tuple[str, str], list[_Answered]] = OrderedDict()

    def may_continue(self, attempt: tuple[str, str]) -> bool:
        """`attempt` has an answered call that a new one may continue, and the tokenizer is not loaded yet: the
        proxy loads it off its event loop first (`fits`, in a thread), so other calls go on meanwhile."""
        return attempt in self._calls and self._fits is None

    @property
    def tokenizer(self) -> Any:
        with self._loading:
            if isinstance(self._tokenizer, str | os.PathLike):
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer)
        return self._tokenizer

    @property
    def fits(self) -> tuple[int, int] | None:
        """The model's context and the vocabulary's longest token in characters, by which a continuation too long
        for the context is refused before it is tokenized whole (`lightning.chat.check_fits`); loads the tokenizer.
        None when the context is unknown (no config.json with max_position_embeddings, no model_max_length)."""
        if self._fits is None:
            tokenizer = self.tokenizer
            context = self._context or _context_length(tokenizer)
            self._fits = (context, longest_token_chars(tokenizer)) if context else (0, 0)
        return self._fits if self._fits[0] else None

    def prompt_for(self, attempt: tuple[str, str], body: dict[str, Any]) -> Continuation:
        """The token-exact prompt of `body` if it continues an earlier call of `attempt`: its messages begin with that
        call's messages and the assistant message it answered, then new ones."""
        messages = body.get("messages")
        if not isinstance(messages, list) or attempt not in self._calls:
            return Continuation()
        self._calls.move_to_end(attempt)
        for earlier in reversed(self._calls[attempt]):
            count = len(earlier.messages)
            if len(messages) <= count + 1 or _canonical(messages[:count]) != _canonical(earlier.messages):
                continue
            if _canonical(body.get("tools")) != _canonical(earlier.tools):
                return Continuation(continues=True, reason="the tools differ from the earlier call's")
            for answer, response_ids in earlier.choices:
                if not response_ids or not _same_answer(messages[count], answer):
                    continue
                try:
                    bridge = continue_conversation(
                        self.tokenizer, messages[: count + 1], messages[count + 1 :],
                        tools=body.get("tools"), last=response_ids[-1], fits=self.fits,
                    )  # fmt: skip
                except (NotAContinuation, PromptTooLong) as exc:  # too long: the server refuses the messages
                    return Continuation(continues=True, reason=str(exc))
                except Exception as exc:  # the template is user data (jinja): its errors are the request's
                    return Continuation(continues=True, reason=f"the chat template failed: {exc}")
                return Continuation(earlier.prompt_ids + response_ids + bridge, continues=True)
            return Continuation(continues=True, reason="the assistant message is not what the model answered")
        return Continuation()

    def remember(self, attempt: tuple[str, str], body: dict[str, Any], call: Call) -> None:
        """Keep an answered chat call (prompt and response ids known) for the calls that continue it."""
        choices = [call.choices[i] for i in sorted(call.choices)]
        prompt_ids = call.prompt_token_ids or (choices[0].prompt_token_ids if choices else None)
        if call.status_code != 200 or prompt_ids is None or not choices:
            return
        if any(choice.token_ids is None for choice in choices):
            return
        answered = [(_message(choice), list(choice.token_ids or [])) for choice in choices]
        calls = self._calls.setdefault(attempt, [])
        self._calls.move_to_end(attempt)
        calls.append(_Answered(list(body["messages"]), body.get("tools"), list(prompt_ids), answered))
        del calls[:-MAX_CALLS]
        while len(self._calls) > MAX_ATTEMPTS:
            self._calls.popitem(last=False)


def _context_length(tokenizer: Any) -> int | None:
    """The model's context in tokens: a model directory's config.json `max_position_embeddings`, else a loaded
    tokenizer's `model_max_length` (transformers says 10^30 for none); None if neither says."""
    if isinstance(tokenizer, str | os.PathLike):
        with contextlib.suppress(OSError, ValueError):
            length = json.loads((Path(tokenizer) / "config.json").read_text()).get("max_position_embeddings")
            return length if isinstance(length, int) and length > 0 else None
        return None
    length = getattr(tokenizer, "model_max_length", None)
    return length if isinstance(length, int) and 0 < length < 10**9 else None


def _message(choice: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"role": choice.role, "content": choice.text or None}
    if choice.tool_calls:
        message["tool_calls"] = [choice.tool_calls[i] for i in sorted(choice.tool_calls)]
    return message


def _same_answer(sent: Any, answer: dict[str, Any]) -> bool:
    """Whether the agent's assistant message is the model's answer: the same text (blank as none) and the same tool
    calls (names, and arguments as JSON values), whatever ids and key order the agent's client gave them."""
    if not isinstance(sent, dict) or sent.get("role") != "assistant":
        return False
    if (_text(sent.get("content")) or "").strip() != (answer.get("content") or "").strip():
        return False
    return _tool_calls(sent.get("tool_calls")) == _tool_calls(answer.get("tool_calls"))


def _text(content: Any) -> str | None:
    if isinstance(content, list):  # content parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else None


def _tool_calls(calls: Any) -> list[tuple[Any, Any]]:
    found = []
    for call in calls or []:
        function = (call.get("function") or {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        found.append((function.get("name"), _canonical(arguments)))
    return found


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
