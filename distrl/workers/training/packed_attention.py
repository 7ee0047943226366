"""Attention over packed sequences without a dense mask: the transformers attention implementation that the
learner's, reference's and critic's models run with (`attn_implementation=PACKED_ATTENTION`).

A packed forward pass puts the real tokens of many sequences side by side in one row `[1, N]`, with `position_ids`
restarting at 0 at each sequence (the convention of transformers' FlashAttention-2 path). sdpa would need a dense
block-diagonal `[N, N]` mask and would spend N^2 work on it; this implementation instead finds the sequences from
the restarts of `position_ids` and attends causally within each one, so attention costs the sum of the squared
sequence lengths, exactly as in separate forward passes, and no mask is built.

Two paths compute the same attention (`attention_path` picks one per call):

    varlen  one `torch.nn.attention.varlen.varlen_attn` call per layer (FlashAttention's varlen kernel, GQA and
            backward), given the cumulative sequence starts `cu_seqlens` found from the restarts: on CUDA in
            bfloat16 or float16, where torch has the API (2.13's signature, with `window_size` and `enable_gqa`),
            without attention dropout and with a head size FlashAttention takes;
    loop    one sdpa call per sequence length per layer (is_causal; the sequences of one length stacked in one
            batch): everywhere else (the CPU, float32, an older torch), and the reference that the varlen path is
            tested against on a GPU (tests/gpu/test_packed_attention.py). RL batches hold a few lengths many
            times over (a group's prompt, responses cut at max_new_tokens), so this is a few calls, not one per
            sequence: on the quickstart's tiny model a call per sequence made the update 1.2x slower than padded
            batches (bench/bench_learner_step.py).

With sequence parallelism (`learner.sequence_parallel_size`), each learner's forward pass holds a slice of the
packed row, and its pack says so (`Pack.split`): the call exchanges heads for tokens with the other learners of its
group around the attention (`distrl.workers.training.ulysses`), which then runs over the whole row as above.

Calls with a padding mask (`attention_mask` given) are plain sdpa, so a model loaded with this implementation still
runs padded batches exactly as before (`padded_response_logprobs`, the packing tests' reference).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from distrl.workers.device import to_device
from distrl.workers.training import ulysses
from distrl.workers.training.ulysses import SequenceSplit

try:  # FlashAttention varlen through torch itself (no flash-attn package); absent from older torch releases
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None  # type: ignore[assignment]

PACKED_ATTENTION = "distrl_packed"

PACKED_ROWS = torch.empty(1, 1, 0, 0, dtype=torch.bool, device="meta")
"""The `attention_mask` of a packed forward pass: a zero-size 4D "mask" that transformers hands to the attention as
it is (a 4D mask counts as prepared), and which this attention reads as "packed rows, no mask". With no mask at all,
transformers would look for packed sequences in `position_ids` itself (`find_packed_sequence_indices`, which reads
a device tensor: a wait for the GPU in every forward pass) only for this attention to ignore what it found."""

VARLEN_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes FlashAttention computes in; float32 runs the loop."""

VARLEN_MAX_HEAD_DIM = 256
"""FlashAttention's largest head size (its head sizes are multiples of 8 up to this)."""


def varlen_available() -> bool:
    """Whether this torch has `varlen_attn` with the arguments used here (torch 2.13: `window_size` for causal
    attention, `enable_gqa` for fewer key/value heads than query heads)."""
    return varlen_attn is not None and _takes_window_and_gqa(varlen_attn)


@functools.cache
def _takes_window_and_gqa(function) -> bool:
    """Read once per function: every layer of every forward pass asks."""
    parameters = inspect.signature(function).parameters
    return "window_size" in parameters and "enable_gqa" in parameters


def sequence_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """`[start, end)` of each sequence of the row `position_ids [N]`: a sequence starts wherever the position does
    not follow the previous one by 1 (transformers' rule, `find_packed_sequence_indices`)."""
    n = position_ids.numel()
    restart = torch.ones(n, dtype=torch.bool, device=position_ids.device)
    restart[1:] = position_ids[1:] != position_ids[:-1] + 1
    starts = restart.nonzero().view(-1).tolist()
    return list(zip(starts, [*starts[1:], n], strict=True))


@dataclass(frozen=True)
class Pack:
    """Where the sequences of a packed batch `[B, N]` are: `bounds[b]`, the `[start, end)` of each sequence of row
    b, and the same as FlashAttention's varlen layout over the B * N tokens flattened row after row: `cu_seqlens
    [S + 1]` int32 (the start of each of the S sequences, then B * N) on the device of the positions, and `longest`,
    the length of the longest. `split`: the forward pass holds only this learner's slice of the row's tokens
    (sequence parallelism, `distrl.workers.training.ulysses`); the bounds are the whole row's."""

    bounds: list[list[tuple[int, int]]]
    cu_seqlens: torch.Tensor
    longest: int
    split: SequenceSplit | None = None
    _stacks: dict[int, Stacks] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, position_ids: torch.Tensor) -> Pack:
        """The pack of `position_ids [B, N]` (one `tolist` that waits for the device, then one small copy back)."""
        bounds = [sequence_bounds(row) for row in position_ids]
        n = position_ids.shape[-1]
        starts = [b * n + s for b, row in enumerate(bounds) for s, _ in row] + [len(bounds) * n]
        longest = max(e - s for row in bounds for s, e in row)
        return cls(bounds, torch.tensor(starts, dtype=torch.int32, device=position_ids.device), longest)

    def stacks(self, rows: int) -> Stacks:
        """The sequences of `rows` rows of queries (each with its own row of `bounds`, or all with the one row)
        grouped by length; made once per pack, on the device of `cu_seqlens`."""
        if rows not in self._stacks:
            self._stacks[rows] = Stacks.of([self.bounds[r if len(self.bounds) > 1 else 0] for r in range(rows)],
                                           self.cu_seqlens.device)
        return self._stacks[rows]


@dataclass(frozen=True)
class Stacks:
    """The sequences of a packed batch of R rows of N tokens, flattened row after row (token r * N + t), grouped by
    length: `lengths[g]` and `index[g] [k_g * L_g]`, the tokens of group g's k_g sequences of length L_g, sequence
    after sequence; `restore [R * N]`, where each token is in the concatenation of the groups' tokens (the inverse
    of concatenating the indexes)."""

    lengths: list[int]
    index: list[torch.Tensor]
    restore: torch.Tensor

    @classmethod
    def of(cls, bounds: list[list[tuple[int, int]]], device: torch.device) -> Stacks:
        n = bounds[0][-1][1]  # every row's sequences end at its last token
        starts: dict[int, list[int]] = defaultdict(list)
        for r, row in enumerate(bounds):
            for s, e in row:
                starts[e - s].append(r * n + s)
        lengths = sorted(starts)
        index = [(torch.tensor(starts[length])[:, None] + torch.arange(length)).view(-1) for length in lengths]
        order = torch.cat(index)
        restore = torch.empty_like(order)
        restore[order] = torch.arange(order.numel())
        return cls(lengths, [to_device(i, device) for i in index], to_device(restore, device))


_last: list[tuple[weakref.ref, Pack]] = []
"""The pack of the last `position_ids` seen (one entry at most): every layer of a forward pass gets the same tensor,
so its sequences are found once per pass, or never when the caller made the pack on the host (`remember`): on a
GPU, finding them from the device's positions (`Pack.of`) waits for the device."""


def remember(position_ids: torch.Tensor, pack: Pack) -> None:
    """Tell the attention that the packed row `position_ids` holds the sequences of `pack` (made on the host from
    the batch's masks, `distrl.workers.training.packing`), for as long as that tensor lives."""
    _last[:] = [(weakref.ref(position_ids), pack)]


def _pack(position_ids: torch.Tensor) -> Pack:
    """The pack `remember`ed for `position_ids [B, N]`, else `Pack.of` it (a wait on a GPU), remembered."""
    if not _last or _last[0][0]() is not position_ids:
        remember(position_ids, Pack.of(position_ids))
    return _last[0][1]


def attention_path(device: str, dtype: torch.dtype, head_dim: int, dropout: float = 0.0) -> Literal["varlen", "loop"]:
    """Which computation a packed call takes for queries on `device` (a device type) in `dtype` with heads of
    `head_dim`: "varlen" (one FlashAttention call) on CUDA in bfloat16 or float16 with torch's API present, no
    attention dropout and a head size FlashAttention takes; else "loop" (one sdpa call per sequence)."""
    if (device == "cuda" and dtype in VARLEN_DTYPES and dropout == 0.0 and head_dim % 8 == 0
            and head_dim <= VARLEN_MAX_HEAD_DIM and varlen_available()):
        return "varlen"
    return "loop"


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of `query [B, H, N, D]` over `key`, `value [B, H_kv, N, D]`, returning `[B, N, H, D]` as
    transformers' sdpa does: per sequence (from `position_ids`, causal within each) when no mask is given, by the
    path `attention_path` picks; else sdpa with the mask. A split pack (sequence parallelism) gives this learner's
    slice of the tokens, N / k of them: heads are exchanged for tokens around the attention (`ulysses`)."""
    position_ids = kwargs.pop("position_ids", None)
    if attention_mask is PACKED_ROWS:
        attention_mask = None
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    window = kwargs.get("sliding_window")  # set by models whose layers attend within a window (Qwen2, Mistral)
    pack = _pack(position_ids)
    if window is not None and pack.longest > window:  # within the window, causal attention is the same thing
        raise ValueError(f"{PACKED_ATTENTION} attention has no sliding window: a sequence of {pack.longest} tokens "
                         f"is longer than the model's sliding_window ({window})")
    split = pack.split
    if split is None:
        return _attend(module, query, key, value, pack, **kwargs), None
    query, key, value = (ulysses.heads_to_tokens(x, split) for x in (query, key, value))
    return ulysses.tokens_to_heads(_attend(module, query, key, value, pack, **kwargs), split), None


def _attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pack: Pack,
            **kwargs) -> torch.Tensor:
    """Causal attention within each sequence of `pack` by the path `attention_path` picks (shapes as
    `varlen_packed`)."""
    one_layout = len(pack.bounds) == query.shape[0]  # not one row of positions shared by many rows of queries
    path = attention_path(query.device.type, query.dtype, query.shape[-1], kwargs.get("dropout", 0.0))
    if one_layout and path == "varlen":
        return varlen_packed(query, key, value, pack, kwargs.get("scaling"))
    return looped_packed(module, query, key, value, pack, **kwargs)


def varlen_packed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pack: Pack,
                  scale: float | None = None) -> torch.Tensor:
    """Causal attention within each sequence of `pack` in one `varlen_attn` call: `query [B, H, N, D]`, `key`,
    `value [B, H_kv, N, D]` (H a multiple of H_kv) to `[B, N, H, D]`."""
    assert varlen_attn is not None
    b, h, n, d = query.shape
    out = varlen_attn(as_tokens(query), as_tokens(key), as_tokens(value), pack.cu_seqlens, pack.cu_seqlens,
                      pack.longest, pack.longest, scale=scale, window_size=(-1, 0), enable_gqa=h != key.shape[1])
    assert isinstance(out, torch.Tensor)  # no auxiliary output was asked for
    return out.view(b, n, h, d)


def looped_packed(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pack: Pack,
                  **kwargs) -> torch.Tensor:
    """Causal attention within each sequence of `pack`, one sdpa call per sequence length, the sequences of that
    length stacked as its batch (shapes as `varlen_packed`)."""
    b, h, n, d = query.shape
    stacks = pack.stacks(b)

    def stacked(x: torch.Tensor, index: torch.Tensor, length: int) -> torch.Tensor:  # -> [k, heads, L, D]
        return x[index].view(-1, length, x.shape[1], d).transpose(1, 2)

    q, k, v = as_tokens(query), as_tokens(key), as_tokens(value)
    out = [sdpa_attention_forward(module, stacked(q, index, length), stacked(k, index, length),
                                  stacked(v, index, length), None, is_causal=True, **kwargs)[0].reshape(-1, h, d)
           for length, index in zip(stacks.lengths, stacks.index, strict=True)]  # each [k * L, H, D]
    return torch.cat(out)[stacks.restore].view(b, n, h, d)


def as_tokens(x: torch.Tensor) -> torch.Tensor:
    """`x [B, heads, N, D]` as `[B * N, heads, D]`: the tokens of its rows, row after row."""
    b, heads, n, d = x.shape
    return x.transpose(1, 2).reshape(b * n, heads, d)


def packed_mask(attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """No mask for packed rows (attention finds the sequences itself); sdpa's mask when there is padding
    (transformers passes every argument by name)."""
    if attention_mask is None:
        return None
    return sdpa_mask(attention_mask=attention_mask, **kwargs)


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, packed_mask)
