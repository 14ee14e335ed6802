"""TrainingBatch: triplets padded into the tensors verl's DataProto carries, under the same key names.

Layout of one row (P = longest kept prompt, R = longest kept response):

    prompts        [pad pad p0 p1 p2]                 left-padded, so every response starts at column P
    responses      [r0 r1 r2 pad]                     right-padded
    input_ids      prompts ++ responses
    attention_mask [0 0 1 1 1 | 1 1 1 0]              1 on real tokens
    position_ids   cumsum(attention_mask) - 1, clamped at 0 (verl's compute_position_id_with_mask)
    response_mask  [1 1 1 0]                          1 on tokens the model generated (0 on tool output)
    token_level_scores [0 0 r 0]                      the reward on the last real response token

Rows are dropped, never silently cut, by the rules in DROP_RULES; `TrainingBatch.dropped` counts them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, Field
from safetensors.torch import load_file, save_file

from lightning import semconv

DROP_RULES: dict[str, str] = {
    "prompt_too_long": "dropped: the prompt has more than max_prompt_length tokens (a cut prompt is not what the "
    "model answered)",
    "empty_response": "dropped: the response has no tokens, so there is no token to put the reward on",
    "missing_reward": "dropped: the reward is None",
    "response_truncated": "kept: the response had more than max_response_length tokens; the first "
    "max_response_length are kept and the reward sits on the last kept token",
    "missing_group_id": "kept: metadata has no group_id; the row is a group of its own (uid 'row-<index>')",
}

ROLLOUT_LOG_PROBS_KEY = semconv.TRIPLET_RESPONSE_LOG_PROBS
"""Triplet metadata key with the sampler's log-prob of each response token; used when every row has it."""

TENSORS_FILE = "tensors.safetensors"
NON_TENSORS_FILE = "batch.json"


class DropReport(BaseModel):
    """Which input triplets (by index) each rule in DROP_RULES hit."""

    num_triplets: int = 0
    prompt_too_long: list[int] = Field(default_factory=list)
    empty_response: list[int] = Field(default_factory=list)
    missing_reward: list[int] = Field(default_factory=list)
    response_truncated: list[int] = Field(default_factory=list)
    missing_group_id: list[int] = Field(default_factory=list)
    rules: dict[str, str] = Field(default_factory=lambda: dict(DROP_RULES))

    @property
    def num_dropped(self) -> int:
        return len(self.prompt_too_long) + len(self.empty_response) + len(self.missing_reward)

    def counts(self) -> dict[str, int]:
        return {rule: len(getattr(self, rule)) for rule in DROP_RULES}


@dataclass
class TrainingBatch:
    """Padded tensors under verl's DataProto keys, plus `uid` (group id per row) and per-row metadata."""

    tensors: dict[str, torch.Tensor]
    uid: np.ndarray
    """Group id of each row as a numpy object array of str, like verl's non_tensor_batch["uid"]."""
    metadata: list[dict[str, Any]]
    dropped: DropReport = field(default_factory=DropReport)
    meta_info: dict[str, Any] = field(default_factory=dict)

    # --- building -----------------------------------------------------------------------------

    @classmethod
    def from_triplets(
        cls,
        triplets: Sequence[Any],
        *,
        pad_token_id: int,
        max_prompt_length: int,
        max_response_length: int,
    ) -> TrainingBatch:
        """Pad triplets into a batch, dropping or truncating rows by DROP_RULES (see `dropped`)."""
        report = DropReport(num_triplets=len(triplets))
        rows = [row for index, t in enumerate(triplets) if (row := _kept_row(index, t, report, max_prompt_length))]
        if not rows:
            raise ValueError(f"no trainable row among {len(triplets)} triplets: {report.counts()}")
        for row in rows:
            if len(row["response"]) > max_response_length:
                report.response_truncated.append(row["index"])
                for key in ("response", "response_mask", "log_probs"):
                    if row[key] is not None:
                        row[key] = row[key][:max_response_length]

        prompts = left_pad([r["prompt"] for r in rows], pad_token_id)
        responses = right_pad([r["response"] for r in rows], pad_token_id)
        prompt_lengths = torch.tensor([len(r["prompt"]) for r in rows])
        response_lengths = torch.tensor([len(r["response"]) for r in rows])
        attention_mask = torch.cat(
            [
                left_length_mask(prompt_lengths, prompts.shape[1]),
                right_length_mask(response_lengths, responses.shape[1]),
            ],
            dim=1,
        )
        tensors = {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask),
            "response_mask": right_pad([r["response_mask"] for r in rows], 0),
            "token_level_scores": reward_on_last_token(
                torch.tensor([r["reward"] for r in rows], dtype=torch.float32), response_lengths, responses.shape[1]
            ),
        }
        if all(r["log_probs"] is not None for r in rows):
            tensors["rollout_log_probs"] = right_pad([r["log_probs"] for r in rows], 0.0, dtype=torch.float32)
        return cls(
            tensors=tensors,
            uid=object_array([r["uid"] for r in rows]),
            metadata=[r["metadata"] for r in rows],
            dropped=report,
            meta_info={
                "pad_token_id": pad_token_id,
                "max_prompt_length": max_prompt_length,
                "max_response_length": max_response_length,
            },
        )

    # --- access -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.uid)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    @property
    def prompt_length(self) -> int:
        """P: the column where every response starts."""
        return self.tensors["prompts"].shape[1]

    def report(self) -> dict[str, Any]:
        """A JSON summary for logs and Prefect artifacts: rows kept, rows hit by each rule, the rules."""
        return {
            "rows": len(self),
            "triplets": self.dropped.num_triplets,
            **self.dropped.counts(),
            "rules": dict(self.dropped.rules),
        }

    def with_tensors(self, extra: dict[str, torch.Tensor]) -> TrainingBatch:
        """The same rows with more per-row tensors (old_log_probs, advantages, ...) alongside."""
        for key, value in extra.items():
            if value.shape[0] != len(self):
                raise ValueError(f"tensor {key!r} has {value.shape[0]} rows, the batch has {len(self)}")
        return replace(self, tensors={**self.tensors, **extra})

    def to(self, device: torch.device | str) -> TrainingBatch:
        return replace(self, tensors={key: value.to(device) for key, value in self.tensors.items()})

    def select(self, indices: Sequence[int] | torch.Tensor) -> TrainingBatch:
        """The rows at `indices`, in that order."""
        index = torch.as_tensor(indices, dtype=torch.long)
        positions = index.tolist()
        return replace(
            self,
            tensors={key: value[index.to(value.device)] for key, value in self.tensors.items()},
            uid=self.uid[positions] if positions else self.uid[:0],
            metadata=[self.metadata[i] for i in positions],
        )

    def split(self, size: int) -> list[TrainingBatch]:
        """Consecutive chunks of `size` rows (the last may be smaller)."""
        if size < 1:
            raise ValueError(f"split size must be at least 1, got {size}")
        return [self.select(range(start, min(start + size, len(self)))) for start in range(0, len(self), size)]

    def split_by_tokens(self, max_tokens: int) -> list[TrainingBatch]:
        """Consecutive chunks whose real (prompt + response) tokens add up to at most `max_tokens`; a row longer than
        that is a chunk of its own."""
        if max_tokens < 1:
            raise ValueError(f"token budget must be at least 1, got {max_tokens}")
        chunks: list[list[int]] = []
        used = max_tokens  # the first row starts a chunk
        for row, length in enumerate(self.tensors["attention_mask"].sum(dim=1).tolist()):
            if used + length > max_tokens:
                chunks.append([])
                used = 0
            chunks[-1].append(row)
            used += length
        return [self.select(rows) for rows in chunks]

    # --- persistence --------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write a directory: tensors as safetensors, everything else as JSON (no pickle)."""
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(
            {key: value.detach().cpu().contiguous() for key, value in self.tensors.items()}, directory / TENSORS_FILE
        )
        non_tensors = {
            "uid": self.uid.tolist(),
            "metadata": self.metadata,
            "dropped": self.dropped.model_dump(),
            "meta_info": self.meta_info,
        }
        # default=str: metadata may hold values JSON has no type for (datetimes, enums); they come back as text.
        (directory / NON_TENSORS_FILE).write_text(json.dumps(non_tensors, default=str))
        return directory

    @classmethod
    def load(cls, path: str | Path) -> TrainingBatch:
        directory = Path(path)
        non_tensors = json.loads((directory / NON_TENSORS_FILE).read_text())
        return cls(
            tensors=load_file(directory / TENSORS_FILE),
            uid=object_array(non_tensors["uid"]),
            metadata=non_tensors["metadata"],
            dropped=DropReport.model_validate(non_tensors["dropped"]),
            meta_info=non_tensors["meta_info"],
        )

    def to_dataproto(self) -> Any:
        """The same batch as a `verl.DataProto` (verl is imported only here: it is a GPU-only dependency)."""
        from verl import DataProto

        return DataProto.from_dict(
            tensors=dict(self.tensors),
            non_tensors={"uid": self.uid, "metadata": object_array(self.metadata)},
            meta_info=dict(self.meta_info),
        )


# --- one row ----------------------------------------------------------------------------------


def _kept_row(index: int, triplet: Any, report: DropReport, max_prompt_length: int) -> dict[str, Any] | None:
    """The row a triplet becomes, or None (noted in `report`) when a drop rule applies."""
    prompt = token_ids(triplet.prompt, "prompt", index)
    response = token_ids(triplet.response, "response", index)
    if len(prompt) > max_prompt_length:
        report.prompt_too_long.append(index)
        return None
    if not response:
        report.empty_response.append(index)
        return None
    if triplet.reward is None:
        report.missing_reward.append(index)
        return None
    metadata = dict(triplet.metadata or {})
    log_probs = metadata.pop(ROLLOUT_LOG_PROBS_KEY, None)
    if log_probs is not None and len(log_probs) != len(response):
        raise ValueError(f"triplet {index}: {len(log_probs)} response log-probs for {len(response)} response tokens")
    group_id = metadata.get("advantage_group", metadata.get("group_id"))  # transitions: task and turn
    if group_id is None:
        report.missing_group_id.append(index)
    return {
        "index": index,
        "prompt": prompt,
        "response": response,
        "response_mask": generated_token_mask(triplet, len(response), index),
        "log_probs": None if log_probs is None else [float(x) for x in log_probs],
        "reward": float(triplet.reward),
        "uid": f"row-{index}" if group_id is None else str(group_id),
        "metadata": metadata,
    }


def token_ids(value: Any, name: str, index: int) -> list[int]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ValueError(f"triplet {index}: {name} must be a list of token ids, got {type(value).__name__}")
    return [int(token) for token in value]


def generated_token_mask(triplet: Any, response_length: int, index: int) -> list[int]:
    """triplet.response_mask when it has one (0 on tool output inside the response), else all ones."""
    mask = getattr(triplet, "response_mask", None)
    if mask is None:
        return [1] * response_length
    if len(mask) != response_length:
        raise ValueError(f"triplet {index}: response_mask has {len(mask)} entries for {response_length} tokens")
    if any(m not in (0, 1) for m in mask):
        raise ValueError(f"triplet {index}: response_mask must hold only 0 and 1")
    return [int(m) for m in mask]


# --- padding and layout -----------------------------------------------------------------------


def left_pad(rows: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([[pad] * (width - len(row)) + list(row) for row in rows], dtype=torch.long)


def right_pad(rows: Sequence[Sequence[float]], pad: float, dtype: torch.dtype = torch.long) -> torch.Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([list(row) + [pad] * (width - len(row)) for row in rows], dtype=dtype)


def left_length_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """1 on the last `length` columns of each row."""
    return (torch.arange(width).unsqueeze(0) >= width - lengths.unsqueeze(1)).long()


def right_length_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """1 on the first `length` columns of each row."""
    return (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """verl's compute_position_id_with_mask: cumsum(mask) - 1, clamped at 0 (left padding sits at 0)."""
    return torch.clamp(torch.cumsum(attention_mask, dim=-1) - 1, min=0)


def reward_on_last_token(rewards: torch.Tensor, response_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] zeros with rewards[i] at column response_lengths[i] - 1."""
    scores = torch.zeros(len(rewards), width, dtype=torch.float32)
    scores[torch.arange(len(rewards)), response_lengths - 1] = rewards
    return scores


def object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D numpy object array (np.array would turn a list of lists into a 2-D array)."""
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array
