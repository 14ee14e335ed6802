"""The trainer's lean forward: response log-probs from the model's last hidden states, the rows packed into one
sequence without their padding (`pack_sequences`), the output layer applied to response tokens only, a chunk at a
time (`logit_chunk_tokens`).

Packing, as transformers supports it without flash-attn: given position ids that restart at 0 for each row and no
attention mask, transformers (>= 4.53) detects the packed rows itself, but with SDPA it then builds a [T x T]
block-diagonal mask and attends over all T^2 pairs (quadratic memory in the micro-batch's tokens). So packed rows
run under an attention function of our own, registered with transformers as `lightning_varlen`: transformers skips
the mask for it, and passes our `cu_seq_lens_q` (the rows' boundaries) through to it. On CUDA in bf16/fp16 it calls
torch's varlen flash attention (`torch.nn.attention.varlen.varlen_attn`, torch >= 2.10); elsewhere SDPA row by row.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

from lightning.algorithm.losses import log_probs_from_hidden

VARLEN_ATTENTION = "lightning_varlen"


def packed_inputs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """[B, W] padded rows -> their real tokens one after another as [1, T], the positions (each row from 0), the rows'
    boundaries cu_seqlens [B + 1] (int32, as flash attention takes them) and the longest row's length."""
    real = attention_mask.bool()
    lengths = real.sum(dim=1)
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return input_ids[real][None], position_ids[real][None], cu_seqlens, int(lengths.max())


def response_positions(
    attention_mask: torch.Tensor, prompt_length: int, packed: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, columns) of every real response token in [B, R], and the index, among the flattened hidden states, of
    the position that predicts it: the token just before it, in the padded [B, W] layout or the packed [T] one."""
    rows, columns = attention_mask[:, prompt_length:].bool().nonzero(as_tuple=True)
    width = attention_mask.shape[1]
    if packed:
        packed_index = attention_mask.flatten().cumsum(0).view(-1, width) - 1
        return rows, columns, packed_index[rows, prompt_length + columns] - 1
    return rows, columns, rows * width + prompt_length + columns - 1


def hidden_state_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    responses: torch.Tensor,
    *,
    pack: bool,
    chunk_tokens: int | None,
    entropy_grad: bool,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, R] log-probs and entropies of the real response tokens (0 on padding) at `temperature`, from the
    decoder's last hidden states and the output layer: padded rows, or with `pack` the rows' real tokens as one
    sequence under `lightning_varlen` attention (`use_varlen_attention` first)."""
    prompt_length = input_ids.shape[1] - responses.shape[1]
    decoder = model.get_decoder()
    if pack:
        ids, positions, cu_seqlens, longest = packed_inputs(input_ids, attention_mask, position_ids)
        hidden = decoder(
            input_ids=ids, position_ids=positions, use_cache=False, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
            max_length_q=longest, max_length_k=longest,
        ).last_hidden_state  # fmt: skip
    else:
        hidden = decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
    rows, columns, index = response_positions(attention_mask, prompt_length, pack)
    head = model.get_output_embeddings()
    log_probs, entropy = log_probs_from_hidden(
        hidden.flatten(0, 1)[index], head.weight, responses[rows, columns], bias=head.bias, chunk_tokens=chunk_tokens,
        entropy_grad=entropy_grad, temperature=temperature,
    )  # fmt: skip
    placed = torch.zeros(responses.shape, dtype=log_probs.dtype, device=log_probs.device)
    return placed.index_put((rows, columns), log_probs), placed.index_put((rows, columns), entropy)


def check_hidden_state_path(model: torch.nn.Module) -> None:
    """Raise ValueError when the model's logits are not its output layer applied to its last hidden states (Gemma's
    soft-capping, Cohere's logit scale): the lean forward would give other log-probs than the model's."""
    config = getattr(model, "config", None)
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(
                f"pack_sequences / logit_chunk_tokens: this model ({type(model).__name__}) transforms its logits "
                f"({name}={getattr(config, name)}), which the lean forward does not; turn both off for it"
            )
    if model.get_output_embeddings() is None or not hasattr(model, "get_decoder"):
        raise ValueError(
            f"pack_sequences / logit_chunk_tokens: {type(model).__name__} has no output layer and decoder to split the "
            "forward at; turn both off for it"
        )


def use_varlen_attention(model: torch.nn.Module) -> None:
    """Run `model`'s attention through `varlen_attention` (registered with transformers once). Checkpoints keep
    their own attention setting: transformers does not save this one in config.json."""
    from transformers import AttentionInterface

    if VARLEN_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)
    model.set_attn_implementation(VARLEN_ATTENTION)


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function over packed rows: query [1, heads, T, d], key and value [1, kv_heads, T, d],
    `cu_seq_lens_q` the rows' boundaries. Causal within each row, nothing across rows. Returns [1, T, heads, d]."""
    if cu_seq_lens_q is None or query.shape[0] != 1:
        raise ValueError(
            f"{VARLEN_ATTENTION} attention takes packed rows ([1, heads, tokens, dim] with cu_seq_lens_q); the trainer "
            "with pack_sequences passes them, other callers should use the model's own attention"
        )
    heads = query.shape[1]
    if key.shape[1] != heads:  # grouped-query attention: each key/value head serves heads // kv_heads query heads
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    dtype = query.dtype
    if query.is_cuda and torch.is_autocast_enabled("cuda"):  # the rotary embedding leaves q and k in float32
        dtype = torch.get_autocast_dtype("cuda")
    q, k, v = (tensor[0].transpose(0, 1).to(dtype) for tensor in (query, key, value))  # [T, heads, d]
    flash = torch_varlen_attention()
    if flash is not None and query.is_cuda and dtype in (torch.bfloat16, torch.float16):
        longest = int(max_length_q) if max_length_q is not None else int(cu_seq_lens_q.diff().max())
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = flash(q, k, v, cu_seq_lens_q, cu_seq_lens_q, longest, longest, scale=scaling)
    else:
        bounds = cu_seq_lens_q.tolist()
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1),
                    is_causal=True, scale=scaling,
                ).transpose(0, 1)
                for start, end in zip(bounds[:-1], bounds[1:], strict=True)
                if end > start
            ]
        )  # fmt: skip
    return out[None], None


def torch_varlen_attention() -> Any:
    """torch's causal varlen flash attention as f(q, k, v, cu_q, cu_k, max_q, max_k, scale=...), or None before torch
    2.10. torch 2.10 takes `is_causal`; later versions a `window_size`, (-1, 0) being causal."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}

    def attend(*args: Any, scale: float | None = None) -> torch.Tensor:
        scaled = {"scale": scale} if "scale" in parameters else {}  # without it: 1/sqrt(d), what Llama-style models use
        return varlen_attn(*args, **scaled, **causal)

    return attend
