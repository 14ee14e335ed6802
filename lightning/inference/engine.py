"""Batched text generation on transformers + torch: one background thread decodes all running requests together."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import random
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import DynamicLayer

from lightning.chat import TextCodec, longest_token_chars
from lightning.checkpoint import adapter_base_model, is_adapter_dir
from lightning.devices import dtype_name, resolve_device, serving_dtype
from lightning.inference.lora import AdapterSlot, adapter_factors
from lightning.mailbox import Mailbox
from lightning.models.files import no_progress_bars

logger = logging.getLogger(__name__)


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    """Choice i samples from a generator seeded with seed + i, so the same request gives the same output."""
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    """None: no logprobs; k >= 0: the sampled token's logprob and the k most likely tokens' logprobs."""


@dataclass
class TokenLogprob:
    """Logprobs of one generated token under the model's raw distribution (before temperature and top_p)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Output:
    """What one choice generated since its previous Output."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None


@dataclass
class GenerationRecord:
    """What one finished request was given and generated, kept in `InferenceEngine.recent`."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[list[int]]
    finish_reasons: list[str]
    model_version: int | str


class _Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.model_version: int | str = 0
        self.loop = asyncio.get_running_loop()
        self.inbox: Mailbox[list[Output | None] | BaseException] = Mailbox(self.loop)
        """What the engine sent, in order (put on the loop's thread, by `_deliver`)."""
        self.output_token_ids: list[list[int]] = [[] for _ in range(params.n)]
        self.finish_reasons = [""] * params.n
        self.unfinished = params.n
        self.cancelled = False

    def send(self, item: list[Output | None] | BaseException) -> None:
        # Called from the engine thread; what the loop's consumer reads may only be touched from the loop's thread.
        self.loop.call_soon_threadsafe(_deliver, [(self, item)])


def _deliver(sent: list[tuple[_Request, list[Output | None] | BaseException]]) -> None:
    """A decoding step's outputs handed to their requests, on the loop's thread: one wake-up of the loop a step,
    not one a request (a write to the loop's self-pipe each; 256 a step at the demo's batch)."""
    for request, item in sent:
        request.inbox.put(item)


class _Row:
    """One choice of one request while it decodes."""

    def __init__(self, request: _Request, index: int):
        self.request = request
        self.index = index
        self.params = request.params
        self.seed = self.params.seed + index if self.params.seed is not None else random.randrange(2**63)
        self.generator: torch.Generator | None = None
        self.token_ids: list[int] = []
        self.text = ""
        self.sent_text = ""
        self.unsent_ids: list[int] = []
        self.unsent_logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None


def _fail(rows: list[_Row], exc: BaseException) -> None:
    """Raise `exc` in the consumers of these rows' requests (once per request)."""
    for request in {row.request: None for row in rows}:
        request.send(exc)


@dataclass
class _Batch:
    """The rows decoding together and their shared state: the KV cache, the attention mask over it, each row's
    next position, and the logits for each row's next token."""

    rows: list[_Row]
    cache: Any
    attention_mask: torch.Tensor
    positions: torch.Tensor
    logits: torch.Tensor


class InferenceEngine:
    """Loads a Hugging Face model directory and generates for many requests at once (continuous batching).

    `generate` may be called from any asyncio loop; the decoding runs in one background thread. New requests join
    the running batch between decode steps; finished rows leave it. `reload` swaps in new weights between batches.
    A LoRA adapter directory (a LoRA checkpoint) in place of a model directory is served merged into its base model:
    a reload of the next adapter merges it into the same base, kept aside, without loading the base again.

    `batch_invariant`: every sequence runs its own forward passes (a batch of one, its own KV cache), so its logits,
    and with a seeded request its tokens, are the same whatever else is decoding: what `deterministic: true` runs
    need. It costs the batching: each step runs the model once per sequence instead of once.

    `device` and `dtype` are the `inference.device` and `inference.dtype` settings (`lightning.devices`): by default
    the GPU when torch sees one, the weights in bfloat16 there and in float32 on a CPU, whatever the checkpoint holds.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str | None = None,
        dtype: str = "auto",
        max_batch_size: int = 32,
        batch_invariant: bool = False,
    ):
        self.device = resolve_device(device, "inference.device")
        self.dtype = serving_dtype(dtype, self.device)
        self.max_batch_size = max_batch_size
        self.batch_invariant = batch_invariant
        self.model_path = str(model_path)
        self.adapters = AdapterSlot()
        self.base_path: str | None = None
        """The whole-weights directory the model was loaded from (for an adapter: its base model)."""
        # Two tokenizers: the server encodes on the event loop thread while the engine thread decodes, and a Rust
        # tokenizer used from two threads at once can fail with "Already borrowed".
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.codec = TextCodec(self.tokenizer)
        """Encodes prompts on the server's event loop thread (`lightning.chat.TextCodec`)."""
        self.token_texts: dict[int, str] = {}
        """Each token's text as `tokenizer.decode([id])` gives it, kept for the logprobs entries of every answer (the
        server's event loop thread's; at most the vocabulary)."""
        self._decoder = TextCodec(AutoTokenizer.from_pretrained(model_path))
        self.model = self._load_model(adapter_base_model(model_path) if is_adapter_dir(model_path) else model_path)
        if is_adapter_dir(model_path):
            factors = adapter_factors(model_path)
            self.adapters.keep_base(self.model, factors)
            self.adapters.apply(self.model, factors)
        self.context_length: int = self.model.config.max_position_embeddings
        self.max_token_chars = longest_token_chars(self.tokenizer)
        """The longest token's text in characters: a text of n characters is at least n / max_token_chars tokens."""
        self.eos_token_ids = self._eos_token_ids()
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = min(self.eos_token_ids) if self.eos_token_ids else 0
        self.version: int | str = 0
        self.reloads = 0
        self.recent: collections.deque[GenerationRecord] = collections.deque(maxlen=1000)
        self.batches_run = 0
        """Prefills run; requests arriving together share one."""
        self.steps_run = 0
        self.max_rows_seen = 0
        """The most rows that one decode step has run together."""
        self._waiting: collections.deque[_Row] = collections.deque()
        self._swaps: list[tuple[Any, dict[str, Any] | None, str, int | str | None, concurrent.futures.Future]] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def _load_model(self, path: str | Path) -> Any:
        with no_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
        logger.info("loaded %s on %s in %s", path, self.device, dtype_name(self.dtype))
        self.base_path = str(Path(path).resolve())
        self.adapters.reset()
        return model.to(self.device).eval()

    def _eos_token_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id if self.model.generation_config is not None else None
        ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return set(ids)

    # ---- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the decoding thread (idempotent; `generate` and `reload` call it too)."""
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name="inference-engine", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=30)

    # ---- the asyncio side ----------------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[Output]:
        """Yields each choice's new tokens and text as they are decoded; the last Output of a choice has its
        finish_reason ("stop" or "length")."""
        request = _Request(request_id, list(prompt_token_ids), params)
        self.start()
        with self._cond:
            self._waiting.extend(_Row(request, index) for index in range(params.n))
            self._cond.notify()
        try:
            while True:
                item = await request.inbox.get()
                if isinstance(item, BaseException):
                    raise item
                for output in item:
                    if output is None:
                        return
                    yield output
        finally:
            # A consumer that stops early (client gone) frees its rows; after a normal finish this changes nothing.
            request.cancelled = True

    async def reload(self, path: str | Path, version: int | str | None = None) -> dict[str, Any]:
        """Load new weights from a Hugging Face directory and swap them in between batches; {"version", "path"}.
        A LoRA adapter directory whose base is the model served is merged into it (only the layers it changes are
        written, in place); an adapter on another base loads that base first.

        The tokenizer stays the same: a checkpoint of the same model shares it.
        """
        model, weights = await asyncio.to_thread(self._prepare, path)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._swaps.append((model, weights, str(path), version, future))
            self._cond.notify()
        self.start()
        return await asyncio.wrap_future(future)

    # ---- the engine thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        # One batch of all running rows; with batch_invariant, one batch per row.
        batches: list[_Batch] = []
        while True:
            with self._cond:
                while not batches and not self._waiting and not self._swaps and not self._stopping:
                    self._cond.wait()
                running = [row for batch in batches for row in batch.rows]
                if self._stopping:
                    waiting, self._waiting = list(self._waiting), collections.deque()
                    _fail(running + waiting, RuntimeError("the inference engine stopped"))
                    return
                swaps = []
                new_rows: list[_Row] = []
                if self._swaps:
                    # Weights change only when no batch runs, so no sequence mixes two models; new requests wait
                    # for the swap so that a reload cannot starve under steady traffic.
                    if not batches:
                        swaps, self._swaps = self._swaps, []
                else:
                    room = self.max_batch_size - len(running)
                    if batches and not self.batch_invariant and not self._can_join(batches[0]):
                        room = 0
                    while self._waiting and room > 0:
                        row = self._waiting.popleft()
                        if not row.request.cancelled:
                            new_rows.append(row)
                            room -= 1
            for swap in swaps:
                self._apply_swap(*swap)
            try:
                with torch.inference_mode():
                    if new_rows:
                        batches = self._admit(batches, new_rows)
                    batches = [stepped for batch in batches if (stepped := self._step(batch)) is not None]
            except Exception as exc:
                logger.exception("generation failed")
                _fail([row for batch in batches for row in batch.rows] + new_rows, exc)
                batches = []

    def _prepare(self, path: str | Path) -> tuple[Any, dict[str, Any] | None]:
        """What a reload swaps in: a model, and for an adapter its factors, merged into the model at the swap (its base
        weights kept aside first)."""
        if not is_adapter_dir(path):
            return self._load_model(path), None
        base = str(adapter_base_model(path).resolve())
        model = self.model if base == self.base_path else self._load_model(base)
        factors = adapter_factors(path)
        self.adapters.keep_base(model, factors)
        return model, factors

    def _apply_swap(
        self,
        model: Any,
        factors: dict[str, Any] | None,
        path: str,
        version: int | str | None,
        future: concurrent.futures.Future,
    ) -> None:
        self.reloads += 1
        if factors is not None:
            self.adapters.apply(model, factors)
        self.model = model
        self.model_path = path
        self.version = version if version is not None else self.reloads
        # The caller may have gone (its future cancelled); the new weights stay.
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            future.set_result({"version": self.version, "path": path})

    @staticmethod
    def _can_join(batch: _Batch) -> bool:
        # Joining pads the KV cache on the left; only plain full-attention caches (Llama, Qwen, ...) allow that.
        return all(type(layer) is DynamicLayer for layer in getattr(batch.cache, "layers", [None]))

    def _admit(self, batches: list[_Batch], rows: list[_Row]) -> list[_Batch]:
        """Prefill the new rows' prompts and add them to the running batch (batch_invariant: a batch each)."""
        for row in rows:
            # On the CPU whatever the model's device: a draw is one number a step, and a GPU generator would cost a
            # device sync per row.
            row.generator = torch.Generator().manual_seed(row.seed)
            row.request.model_version = self.version
        if self.batch_invariant:
            return batches + [self._prefill([row]) for row in rows]
        new = self._prefill(rows)
        return [new] if not batches else [self._merge(batches[0], new)]

    def _prefill(self, rows: list[_Row]) -> _Batch:
        """Run the rows' prompts, left-padded to one length: a batch of them with each row's next-token logits."""
        prompts = [row.request.prompt_token_ids for row in rows]
        length = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, length - len(prompt) :] = torch.tensor(prompt)
            attention_mask[i, length - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        # Positions count real tokens only, so a left-padded row sees the same positions as it would alone.
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True, logits_to_keep=1
        )
        self.batches_run += 1
        return _Batch(rows, out.past_key_values, attention_mask, positions[:, -1:], out.logits[:, -1].float())

    @staticmethod
    def _merge(a: _Batch, b: _Batch) -> _Batch:
        """One batch from two: the shorter cache is left-padded (masked out) to the longer one's length."""
        length = max(a.attention_mask.shape[1], b.attention_mask.shape[1])
        for part in (a, b):
            pad = length - part.attention_mask.shape[1]
            if pad:
                part.attention_mask = F.pad(part.attention_mask, (pad, 0))
                for layer in part.cache.layers:
                    layer.keys = F.pad(layer.keys, (0, 0, pad, 0))
                    layer.values = F.pad(layer.values, (0, 0, pad, 0))
        for layer_a, layer_b in zip(a.cache.layers, b.cache.layers, strict=True):
            layer_a.keys = torch.cat([layer_a.keys, layer_b.keys])
            layer_a.values = torch.cat([layer_a.values, layer_b.values])
        return _Batch(
            a.rows + b.rows,
            a.cache,
            torch.cat([a.attention_mask, b.attention_mask]),
            torch.cat([a.positions, b.positions]),
            torch.cat([a.logits, b.logits]),
        )

    def _step(self, batch: _Batch) -> _Batch | None:
        """Sample one token for every row, send what is new, drop finished rows, and run the model one step."""
        rows = batch.rows
        self.steps_run += 1
        self.max_rows_seen = max(self.max_rows_seen, len(rows))
        # The whole batch is sampled, and its log-probs read, in one pass each: one device sync a step, not a few
        # per row (on a GPU those syncs were most of a decode step).
        tokens = self._sample(batch.logits, rows)
        logprobs = self._logprobs(batch.logits, tokens, [row.params.logprobs for row in rows])
        next_ids = []
        for i, row in enumerate(rows):
            if row.request.cancelled:
                row.finish_reason = "abort"
                next_ids.append(self.pad_token_id)
                continue
            token = tokens[i]
            row.token_ids.append(token)
            row.unsent_ids.append(token)
            if logprobs[i] is not None:
                row.unsent_logprobs.append(logprobs[i])
            self._update_text_and_finish(row, token)
            next_ids.append(token)
        self._send(rows)

        keep = [i for i, row in enumerate(rows) if row.finish_reason is None]
        if not keep:
            return None
        cache, attention_mask, positions = batch.cache, batch.attention_mask, batch.positions
        if len(keep) < len(rows):
            index = torch.tensor(keep, device=self.device)
            cache.batch_select_indices(index)
            attention_mask, positions = attention_mask[index], positions[index]
        attention_mask = F.pad(attention_mask, (0, 1), value=1)
        positions = positions + 1
        input_ids = torch.tensor([[next_ids[i]] for i in keep], device=self.device)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        return _Batch(
            [rows[i] for i in keep], out.past_key_values, attention_mask, positions, out.logits[:, -1].float()
        )

    @staticmethod
    def _sample(logits: torch.Tensor, rows: list[_Row]) -> list[int]:
        """One next token for each row (`logits`: rows x vocabulary). Temperature 0 takes the argmax. Otherwise the
        logits are divided by the temperature, cut to the top_p nucleus, and drawn from by inverse CDF: row i takes
        the first token whose cumulative probability passes u_i times the kept mass, u_i a uniform from the row's
        own seeded generator. So a row's tokens depend only on its logits and its seed, whatever shares its batch."""
        device = logits.device
        greedy = logits.argmax(-1)
        if all(row.params.temperature == 0 for row in rows):
            return greedy.tolist()
        temperature = torch.tensor([row.params.temperature for row in rows], dtype=logits.dtype, device=device)
        sampled = temperature > 0
        probs = torch.softmax(logits / torch.where(sampled, temperature, 1.0)[:, None], -1)
        if any(row.params.top_p < 1 for row in rows):
            top_p = torch.tensor([row.params.top_p for row in rows], dtype=probs.dtype, device=device)
            sorted_probs, order = probs.sort(-1, descending=True)
            # Keep the smallest set of most likely tokens whose mass reaches top_p (always the top token).
            sorted_probs[sorted_probs.cumsum(-1) - sorted_probs >= top_p[:, None]] = 0
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        cdf = probs.cumsum(-1)
        u = [float(torch.rand((), generator=row.generator)) if row.params.temperature > 0 else 0.0 for row in rows]
        threshold = torch.tensor(u, dtype=cdf.dtype, device=device) * cdf[:, -1]
        drawn = torch.searchsorted(cdf, threshold[:, None], right=True).squeeze(1).clamp_(max=cdf.shape[-1] - 1)
        return torch.where(sampled, drawn, greedy).tolist()

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: list[int], wanted: list[int | None]) -> list[TokenLogprob | None]:
        """Each row's sampled token's log-prob and its top-k (k = `wanted[i]`; None: the row wants none), under the
        raw distribution, read for the whole batch at once."""
        if all(k is None for k in wanted):
            return [None] * len(tokens)
        logprobs = torch.log_softmax(logits, -1)
        chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None]).squeeze(1).tolist()
        values: list[list[float]] = [[] for _ in tokens]
        ids: list[list[int]] = [[] for _ in tokens]
        k_max = max(k or 0 for k in wanted)
        if k_max:
            top = logprobs.topk(k_max, -1)
            values, ids = top.values.tolist(), top.indices.tolist()
        return [
            None if k is None else TokenLogprob(token, chosen[i], list(zip(ids[i][:k], values[i][:k], strict=True)))
            for i, (token, k) in enumerate(zip(tokens, wanted, strict=True))
        ]

    def _update_text_and_finish(self, row: _Row, token: int) -> None:
        params = row.params
        if token in self.eos_token_ids or token in params.stop_token_ids:
            row.finish_reason = "stop"
            row.text = self._decoder.decode(row.token_ids[:-1])
            return
        # Decoding the whole list (not token by token) keeps multi-byte characters and merges right.
        row.text = self._decoder.decode(row.token_ids)
        found = [i for i in (row.text.find(stop) for stop in params.stop) if i >= 0]
        if found:
            row.finish_reason = "stop"
            row.text = row.text[: min(found)]
        else:
            total = len(row.request.prompt_token_ids) + len(row.token_ids)
            if len(row.token_ids) >= params.max_tokens or total >= self.context_length:
                row.finish_reason = "length"

    @staticmethod
    def _sendable_text_end(text: str, stops: list[str]) -> int:
        """How much of an unfinished row's text is final: not an incomplete UTF-8 character (decoded as U+FFFD,
        which the next byte may complete) and not the start of a stop string (which would be cut)."""
        end = len(text.rstrip("\ufffd"))
        for stop in stops:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    end = min(end, len(text) - k)
                    break
        return end

    def _send(self, rows: list[_Row]) -> None:
        outputs: dict[_Request, list[Output | None]] = {}
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Request, list[Output | None] | BaseException]]] = {}
        for row in rows:
            if row.finish_reason == "abort":
                continue
            request = row.request
            end = len(row.text) if row.finish_reason else self._sendable_text_end(row.text, row.params.stop)
            delta = ""
            # Text already sent cannot be taken back; if decoding changed it (rare), hold until it agrees again.
            if end > len(row.sent_text) and row.text.startswith(row.sent_text):
                delta = row.text[len(row.sent_text) : end]
                row.sent_text += delta
            outputs.setdefault(request, []).append(
                Output(row.index, row.unsent_ids, delta, row.unsent_logprobs, row.finish_reason)
            )
            row.unsent_ids, row.unsent_logprobs = [], []
            if row.finish_reason:
                request.output_token_ids[row.index] = row.token_ids
                request.finish_reasons[row.index] = row.finish_reason
                request.unfinished -= 1
        for request, items in outputs.items():
            if request.unfinished == 0:
                self.recent.append(
                    GenerationRecord(
                        request.request_id,
                        request.prompt_token_ids,
                        request.output_token_ids,
                        request.finish_reasons,
                        request.model_version,
                    )
                )
                items.append(None)
            by_loop.setdefault(request.loop, []).append((request, items))
        for loop, sent in by_loop.items():
            loop.call_soon_threadsafe(_deliver, sent)
