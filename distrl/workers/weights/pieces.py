"""A bucket as the learners hold it, and its assembly where an engine loads it.

Each learner sends its own `Pieces` of a bucket: the rows it holds of each tensor (a replica's learner 0 holds
every row; FSDP2 learners each hold a contiguous block of the first dimension, `Shard(0)`), so that no learner
sends, and none gathers, the whole model. An engine's side assembles a bucket's full tensors from every learner's
pieces (`assemble`): a tensor held whole by one learner is used as it is (no copy); one held in blocks is copied
block by block into a tensor of the full shape, which `allocate` provides (plain memory, or memory the engine's
worker processes map: `distrl.workers.rollout.shared_bucket`). Every row must come from exactly one learner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from distrl.workers.weights.export import Bucket, Spec


@dataclass
class Pieces:
    """One learner's part of a bucket: `tensors[name]` holds rows `rows[name]` to `rows[name] +
    tensors[name].shape[0]` of the full tensor `name` (its other dimensions whole). Tensors pickle as raw bytes
    (`Bucket`): an engine maps them from the object store rather than copying them."""

    tensors: Bucket = field(default_factory=Bucket)
    rows: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def whole(tensors: dict[str, torch.Tensor]) -> Pieces:
        """Pieces that hold every row of each of `tensors` (a replica's bucket)."""
        return Pieces(Bucket(tensors), dict.fromkeys(tensors, 0))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass
class BucketParts:
    """What an engine is handed for one bucket: its layout (`spec`: each tensor's HF name and full shape, in order)
    and every learner's `Pieces` of it."""

    spec: Spec
    parts: list[Pieces]

    @staticmethod
    def whole(tensors: dict[str, torch.Tensor]) -> BucketParts:
        """A bucket of `tensors` held whole by one learner (a replica, a hybrid actor's own learner)."""
        return BucketParts([(name, tuple(t.shape)) for name, t in tensors.items()], [Pieces.whole(tensors)])


Allocate = Callable[[Spec, torch.dtype], dict[str, torch.Tensor]]
"""`allocate(spec, dtype)`: empty tensors of `spec`'s full shapes in `dtype`, by name."""


def _empty(spec: Spec, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: torch.empty(shape, dtype=dtype) for name, shape in spec}


def assemble(bucket: BucketParts, allocate: Allocate | None = None) -> dict[str, torch.Tensor]:
    """The full tensors of `bucket`, by name in `spec` order. With `allocate` every tensor is copied into the memory
    it provides; without, a tensor that one learner holds whole is returned as it is, and the others are copied into
    plain memory. Raises ValueError naming the tensor if the learners' rows do not cover it exactly once."""
    held = {name: [(p.rows[name], p.tensors[name]) for p in bucket.parts if name in p.tensors]
            for name, _ in bucket.spec}
    dtypes = {t.dtype for blocks in held.values() for _, t in blocks}
    if len(dtypes) > 1:
        raise ValueError(f"the learners sent one bucket in several dtypes: {sorted(map(str, dtypes))}")
    out: dict[str, torch.Tensor] = {}
    copied: Spec = []
    for name, shape in bucket.spec:
        _check_rows(name, tuple(shape), held[name])
        if allocate is None and len(held[name]) == 1:
            out[name] = held[name][0][1]  # held whole by one learner
        else:
            copied.append((name, shape))
    if copied:
        into = (allocate or _empty)(copied, dtypes.pop())
        for name, _ in copied:
            for start, block in held[name]:
                (into[name][start:start + block.shape[0]] if block.dim() else into[name]).copy_(block)
        out.update(into)
    return {name: out[name] for name, _ in bucket.spec}


def _check_rows(name: str, shape: tuple[int, ...], blocks: list[tuple[int, torch.Tensor]]) -> None:
    """Raise ValueError unless `blocks` ((first row, rows) each) tile the rows of a `shape` tensor exactly once (a
    0-dimensional tensor: one block of its shape)."""
    rows = shape[0] if shape else 1
    covered = 0
    for start, block in sorted(blocks, key=lambda b: b[0]):
        if start != covered or tuple(block.shape[1:]) != shape[1:] or (not shape and block.dim()):
            raise ValueError(f"{name}: the learners' pieces do not tile its {rows} rows of shape {shape} (a piece "
                             f"of shape {tuple(block.shape)} at row {start}, after {covered} rows)")
        covered += block.shape[0] if block.dim() else 1
    if covered != rows:
        raise ValueError(f"{name}: the learners sent {covered} of its {rows} rows (shape {shape})")
