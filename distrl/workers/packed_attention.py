"""Attention over packed sequences without a dense mask: the transformers attention implementation that the
learner's, reference's and critic's models run with (`attn_implementation=PACKED_ATTENTION`).

A packed forward pass puts the real tokens of many sequences side by side in one row `[1, N]`, with `position_ids`
restarting at 0 at each sequence (the convention of transformers' FlashAttention-2 path). sdpa would need a dense
block-diagonal `[N, N]` mask and would spend N^2 work on it; this implementation instead finds the sequences from
the restarts of `position_ids` and runs sdpa with `is_causal=True` on each one, so attention costs the sum of the
squared sequence lengths, exactly as in separate forward passes, and no mask is built.

Calls with a padding mask (`attention_mask` given) are plain sdpa, so a model loaded with this implementation still
runs padded batches exactly as before (`padded_response_logprobs`, the packing tests' reference). It works on any
device sdpa does; on a GPU each sequence is one sdpa kernel launch per layer.
"""

from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

PACKED_ATTENTION = "distrl_packed"


def sequence_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """`[start, end)` of each sequence of the row `position_ids [N]`: a sequence starts wherever the position does
    not follow the previous one by 1 (transformers' rule, `find_packed_sequence_indices`)."""
    n = position_ids.numel()
    restart = torch.ones(n, dtype=torch.bool, device=position_ids.device)
    restart[1:] = position_ids[1:] != position_ids[:-1] + 1
    starts = restart.nonzero().view(-1).tolist()
    return list(zip(starts, [*starts[1:], n], strict=True))


_last: list[tuple[weakref.ref, list[list[tuple[int, int]]]]] = []
"""The bounds of the last `position_ids` seen (one entry at most): every layer of a forward pass gets the same tensor,
so they are found once per pass (on a GPU, `tolist` waits for the device; once per layer it would stall every
layer's launch)."""


def _bounds_per_row(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """`sequence_bounds` of each row of `position_ids [B, N]`, remembered for as long as that tensor lives."""
    if not _last or _last[0][0]() is not position_ids:
        _last[:] = [(weakref.ref(position_ids), [sequence_bounds(row) for row in position_ids])]
    return _last[0][1]


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of `query [B, H, N, D]` over `key`, `value [B, H_kv, N, D]`, returning `[B, N, H, D]` as
    transformers' sdpa does: per sequence (from `position_ids`, causal within each) when no mask is given, else
    sdpa with the mask."""
    position_ids = kwargs.pop("position_ids", None)
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    window = kwargs.get("sliding_window")  # set by models whose layers attend within a window (Qwen2, Mistral)
    per_row = _bounds_per_row(position_ids)
    rows = []
    for b in range(query.shape[0]):
        bounds = per_row[b if len(per_row) > 1 else 0]
        longest = max(e - s for s, e in bounds)
        if window is not None and longest > window:  # within the window, causal attention is the same thing
            raise ValueError(f"{PACKED_ATTENTION} attention has no sliding window: a sequence of {longest} tokens is "
                             f"longer than the model's sliding_window ({window})")
        rows.append(torch.cat([
            sdpa_attention_forward(module, query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e], None,
                                   is_causal=True, **kwargs)[0]
            for s, e in bounds
        ], dim=1))
    return torch.cat(rows, dim=0), None


def packed_mask(attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """No mask for packed rows (attention finds the sequences itself); sdpa's mask when there is padding
    (transformers passes every argument by name)."""
    if attention_mask is None:
        return None
    return sdpa_mask(attention_mask=attention_mask, **kwargs)


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, packed_mask)
