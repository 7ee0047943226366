"""Weight fingerprints: what a rollout engine proves about the weights it serves after a push.

A fingerprint maps each HF tensor name to `(checksum, scale)`, computed from a fixed *sample* of the tensor: every
row, at `SAMPLE_COLUMNS` fixed columns (all of a 1-D tensor). The sample is an `[N, S]` float64 matrix; the checksum
weighs each entry by a fixed pseudo-random weight in [1, 2) that depends on its position, so a missing update, a
tensor loaded into the wrong place, swapped rows or a stale bucket all change it; `scale` (the same sum over
absolute values) sizes the tolerance.

A worker of a tensor-parallel engine holds a *region* of some HF tensors: a block of rows (`(0, start, length)`: a
column-parallel projection's output rows, a vocabulary shard) or of columns (`(1, start, length)`: a row-parallel
projection's input columns; a block of a later dimension, `(2, start, length)`, of a stack of experts' projections
`[E, out, in]`), the tensor whole (`None`) for the rest; one worker may hold several regions of a tensor (the gate
and up halves of experts' fused `gate_up_proj`). Its fingerprint is keyed by `key(name, region)`, and is the
fingerprint of the region as a tensor of its own: the sample of the rows (or columns) it holds. The learners
compute the same from the full tensor's rows they hold (`of_rows`): the checksum is a sum over the sampled entries,
so every learner's part of it can be computed from its own rows (a sharded learner holds a block of the first
dimension) and the parts added (`add`), without gathering a tensor anywhere.

Both sides build the same sample from what they hold: the learners from their own weights cast to the rollout dtype
(what they sent), the engine's workers from their own parameters, or, for layers whose weights vLLM has repacked for
its kernels (on CPU the packed oneDNN form replaces the parameter), by running the layer's own GEMM on one-hot inputs
(`distrl.workers.rollout.served_weights`), which returns the sampled columns exactly as the kernel uses them. Equal
inputs give float64 sums equal to the last bits or two (parts added in another order); the tolerance (`RTOL` of
`scale`) absorbs that and summation order on other hardware.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

import numpy as np
import torch

SAMPLE_COLUMNS = 8
RTOL = 1e-12

Fingerprint = dict[str, tuple[float, float]]
"""`key(name, region)` -> (checksum, scale)."""

Region = tuple[int, int, int] | None
"""The part of an HF tensor a worker holds: `(dim, start, length)`, indices `start` to `start + length` of dimension
`dim` (rows: 0, columns: 1, ...) and every index of the others; None: the whole tensor."""

Held = list[tuple[str, Region]]
"""The regions of HF tensors one worker holds, (name, region) each: a tensor may appear with several regions."""


class WeightMismatch(RuntimeError):
    """An engine serves weights other than those the learners pushed."""


def columns(width: int) -> torch.Tensor:
    """The fixed sample of column indices of a tensor `width` columns wide (all of them when there are few)."""
    if width <= SAMPLE_COLUMNS:
        return torch.arange(width)
    generator = torch.Generator().manual_seed(width)
    return torch.randperm(width, generator=generator)[:SAMPLE_COLUMNS].sort().values


def sample(tensor: torch.Tensor) -> torch.Tensor:
    """`[N, S]` sample of `tensor`: all of a 1-D `[N]` tensor as `[N, 1]`; dimensions after the first are flattened
    into columns, of which `columns` picks S."""
    if tensor.dim() <= 1:
        return tensor.reshape(-1, 1)
    rows = tensor.reshape(tensor.shape[0], -1)
    return rows[:, columns(rows.shape[1]).to(rows.device)]


@functools.lru_cache(maxsize=64)
def _position_weights(n: int, s: int) -> torch.Tensor:
    """`[n, s]` float64 weights in [1, 2): the top 16 bits of splitmix64's finaliser of the position index r*s + c,
    in numpy's wrapping uint64 arithmetic, so the same on every machine; no two positions share a period."""
    z = np.arange(n * s, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return torch.from_numpy(1.0 + (z >> np.uint64(48)).astype(np.float64) / 65536.0).reshape(n, s)


def of_sample(values: torch.Tensor) -> tuple[float, float]:
    """(checksum, scale) of an `[N, S]` sample."""
    values = values.detach().to("cpu", torch.float64)
    weights = _position_weights(*values.shape)
    return float((values * weights).sum()), float((values.abs() * weights).sum())


def of_tensors(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> Fingerprint:
    """Fingerprint of HF-named tensors as they are served in `dtype` (the learner's side: its weights as sent)."""
    with torch.no_grad():
        return {name: of_sample(sample(tensor).to(dtype)) for name, tensor in named}


def key(name: str, region: Region) -> str:
    """The fingerprint key of `region` of tensor `name`: the name itself for the whole tensor."""
    return name if region is None else f"{name}[{region[0]}:{region[1]}:{region[2]}]"


def of_rows(block: torch.Tensor, first_row: int, full_rows: int, region: Region) -> tuple[float, float]:
    """The part of `region`'s (checksum, scale) that rows `first_row` to `first_row + len(block)` of a tensor of
    `full_rows` rows hold: `block` is those rows (already in the sent dtype). The parts of every block of rows add up
    to `of_sample(sample(the region as a tensor))`; the whole tensor as one block gives exactly that."""
    dim, start, length = region if region is not None else (0, 0, full_rows)
    if dim == 0:
        lo, hi = max(first_row, start), min(first_row + block.shape[0], start + length)
        if hi <= lo:
            return 0.0, 0.0
        rows, first, n = block[lo - first_row:hi - first_row], lo - start, length
    else:
        rows, first, n = block.narrow(dim, start, length), first_row, full_rows
    values = sample(rows).detach().to("cpu", torch.float64)
    weights = _position_weights(n, values.shape[1])[first:first + values.shape[0]]
    return float((values * weights).sum()), float((values.abs() * weights).sum())


def of_blocks(blocks: Iterable[tuple[str, torch.Tensor, int, int]], regions: Mapping[str, list[Region]] | None,
              dtype: torch.dtype) -> Fingerprint:
    """The part of the fingerprint of `regions` (name -> the regions some engine worker holds) that `blocks` hold:
    (name, rows, index of the first, the full tensor's row count) each, cast to `dtype` as they are sent. Tensors
    that no region names are left out; without `regions`, every tensor whole (an engine at TP 1)."""
    out: Fingerprint = {}
    with torch.no_grad():
        for name, block, first, full_rows in blocks:
            sent = block.to(dtype).reshape(1) if block.dim() == 0 else block.to(dtype)
            for region in regions.get(name, ()) if regions is not None else (None,):
                out[key(name, region)] = of_rows(sent, first, full_rows, region)
    return out


def add(parts: Iterable[Fingerprint]) -> Fingerprint:
    """The fingerprint whose every entry is the sum of `parts`' entries under its key (the learners' parts)."""
    out: dict[str, list[float]] = {}
    for part in parts:
        for name, (checksum, scale) in part.items():
            total = out.setdefault(name, [0.0, 0.0])
            total[0] += checksum
            total[1] += scale
    return {name: (checksum, scale) for name, (checksum, scale) in out.items()}


def first_mismatch(expected: Fingerprint, served: Fingerprint) -> str | None:
    """None if `served` matches `expected` for every tensor of `expected`; otherwise what differs: the first tensor
    (in `expected`'s order) that is missing or has another checksum, and how many differ."""
    wrong = []
    for name, (checksum, scale) in expected.items():
        if name not in served:
            wrong.append(f"{name} is not among the tensors it serves")
        elif abs(served[name][0] - checksum) > RTOL * max(scale, served[name][1]):
            wrong.append(f"{name} differs (checksum {served[name][0]:.17g}, the learners' {checksum:.17g})")
    if not wrong:
        return None
    return f"{wrong[0]}; {len(wrong)} of {len(expected)} tensors differ"


def check(expected: Fingerprint, served: Fingerprint, engine: str, version: int) -> None:
    """Raise WeightMismatch if engine `engine` (an engine, or one worker of it), having loaded `version`, serves
    other weights than `expected`."""
    problem = first_mismatch(expected, served)
    if problem:
        raise WeightMismatch(f"{engine} serves weights other than the learners' after loading version {version}: "
                             f"{problem} (cluster.verify_weights=false turns this check off)")
