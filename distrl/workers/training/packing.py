"""The packed layout of a micro-batch, computed on the host from what the host already has: the batch's attention
and response masks arrive on the CPU from the driver, so where every sequence starts, which positions predict a
response token and FlashAttention's `cu_seqlens` are found there, in numpy, before the forward pass, and copied to
the device without waiting for it (pinned memory, `non_blocking`). Reading them back from device tensors would make
the host wait for the GPU in every micro-batch (and every layer).

A packed forward pass puts the real tokens of the B rows side by side in one row `[1, N]`, in the row-major order of
the padded batch, with `position_ids` restarting at 0 at each sequence's first real token (transformers' packing
convention), so the model's attention (`PACKED_ATTENTION`) keeps the sequences apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from distrl.types.batches import Sequences
from distrl.workers.device import to_device
from distrl.workers.training import ulysses
from distrl.workers.training.packed_attention import Pack
from distrl.workers.training.ulysses import SequenceSplit


@dataclass(frozen=True)
class Layout:
    """Where the tokens of a packed micro-batch of B rows (P + T columns) are.

    ids          [1, N] long  the real tokens, row after row (one filler token when there is none)
    position_ids [1, N] long  each token's position in its own sequence
    predicts     [K]    long  the packed positions whose next token is a real response token, row-major
    targets      [K]    long  those response tokens (`ids[predicts + 1]`)
    response     [B, T] bool  the K real response tokens in the padded layout
    response_index [K]  long  the same as indices into the B * T flattened layout
    pack         the sequences' bounds and `cu_seqlens` for the attention (`packed_attention.Pack`), whose
                 `cu_seqlens` is on the device of the other tensors
    kept         split over a sequence-parallel group (`split`): how many of the K response tokens each learner's
                 slice predicts, in the group's order (ids, position_ids, predicts and targets are then this
                 learner's slice's: N / k tokens, K_r of them); None for the whole row
    routes       [N, L, k] uint8 or int16  the packed tokens' replayed experts (`Sequences.routes`), or None
    routed       [N] bool  the packed tokens `routes` holds (the others' routers choose their own), or None
    """

    ids: torch.Tensor
    position_ids: torch.Tensor
    predicts: torch.Tensor
    targets: torch.Tensor
    response: torch.Tensor
    response_index: torch.Tensor
    pack: Pack
    kept: tuple[int, ...] | None = None
    routes: torch.Tensor | None = None
    routed: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> Layout:
        """This layout on `device` (`to_device`: no wait on a GPU)."""
        moved = {name: to_device(getattr(self, name), device)
                 for name in ("ids", "position_ids", "predicts", "targets", "response", "response_index")}
        routes = {name: None if getattr(self, name) is None else to_device(getattr(self, name), device)
                  for name in ("routes", "routed")}
        pack = Pack(self.pack.bounds, to_device(self.pack.cu_seqlens, device), self.pack.longest, self.pack.split)
        return Layout(**moved, pack=pack, kept=self.kept, routes=routes["routes"], routed=routes["routed"])

    def split(self, split: SequenceSplit) -> Layout:
        """This learner's slice of the whole row's layout (on the host) over its sequence-parallel group: the N
        tokens padded to a multiple of k with a sequence of filler tokens (id 0, positions from 0: attention keeps it
        apart, and it predicts nothing), then slice `split.rank` of the k equal ones; the pack stays the whole row's,
        marked split (`ulysses`)."""
        assert self.pack.split is None and self.kept is None, "a layout is split once"
        if self.routes is not None:  # refused at load (`rollout.routing_replay`): the routes are not sliced
            raise ValueError("routing replay with sequence-parallel learners: a split layout carries no routes")
        n = self.ids.shape[1]
        width = -(-n // split.size)
        pad = width * split.size - n
        ids = torch.cat([self.ids, self.ids.new_zeros(1, pad)], 1)
        positions = torch.cat([self.position_ids, torch.arange(pad, dtype=self.position_ids.dtype)[None]], 1)
        bounds = [self.pack.bounds[0] + ([(n, n + pad)] if pad else [])]
        cu_seqlens = torch.cat([self.pack.cu_seqlens, torch.tensor([n + pad], dtype=torch.int32)]) if pad else \
            self.pack.cu_seqlens
        pack = Pack(bounds, cu_seqlens, max(self.pack.longest, pad), split)
        slice_of = self.predicts // width  # which learner's slice predicts each response token
        mine = slice_of == split.rank
        first = split.rank * width
        return Layout(ids=ids[:, first:first + width], position_ids=positions[:, first:first + width],
                      predicts=self.predicts[mine] - first, targets=self.targets[mine], response=self.response,
                      response_index=self.response_index, pack=pack,
                      kept=tuple(torch.bincount(slice_of, minlength=split.size).tolist()))

    def gather(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """Values `[K_r]` of this learner's slice's response tokens as `[K]`, every learner's of the group in order
        (`ulysses.gather_kept`, differentiable); a whole row's `[K]` as they are."""
        if values is None or self.kept is None:
            return values
        assert self.pack.split is not None
        return ulysses.gather_kept(values, self.kept, self.pack.split)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """`[K]` values of the response tokens into the padded layout `[B, T]`, 0 elsewhere (differentiable; an
        index known on the host, where a boolean mask would make the device count its ones)."""
        out = values.new_zeros(self.response.numel())
        return out.index_put((self.response_index,), values).view(self.response.shape)


def host_layout(batch: Sequences) -> Layout:
    """The layout of `batch`, computed on the host (`batch` on the CPU; a device batch's masks are copied back once,
    which waits). Raises when a response token follows padding: every response token must be predicted from a real
    token of its own sequence."""
    real = _host(batch.attention_mask).astype(bool)
    ids_all = _host(batch.input_ids)
    p = batch.prompt_len
    if p == 0:
        raise ValueError("Sequences: no prompt column; every sequence needs a real prompt token to predict from")
    response = np.ascontiguousarray(real[:, p:])  # every real response token, observations (response_mask 0) included
    # Response token t sits at column P + t and is predicted by column P + t - 1, which must be real too.
    predicts = np.zeros_like(real)
    predicts[:, p - 1:-1] = response & real[:, p - 1:-1]
    if predicts.sum() != response.sum():
        raise ValueError("Sequences: a response token follows padding (every sequence needs a real prompt token)")
    rank = np.cumsum(real, -1) - 1  # position of each real token in its own sequence
    ids, positions = ids_all[real], rank[real]
    lengths = real.sum(-1)
    if ids.size == 0:
        ids, positions, lengths = np.zeros(1, ids_all.dtype), np.zeros(1, rank.dtype), np.ones(1, lengths.dtype)
    keep = np.flatnonzero(predicts[real]) if real.any() else np.zeros(0, np.int64)
    ends = np.cumsum(lengths[lengths > 0])
    starts = ends - lengths[lengths > 0]
    n = int(ids.size)
    routes = routed = None
    if batch.routes is not None and batch.routed is not None and real.any():
        routes, routed = torch.from_numpy(_host(batch.routes)[real]), torch.from_numpy(_host(batch.routed)[real])
    pack = Pack([list(zip(starts.tolist(), ends.tolist(), strict=True))],
                torch.from_numpy(np.append(starts, n).astype(np.int32)), int(lengths.max()))
    return Layout(ids=torch.from_numpy(ids)[None].long(), position_ids=torch.from_numpy(positions)[None].long(),
                  predicts=torch.from_numpy(keep).long(), targets=torch.from_numpy(ids[keep + 1]).long(),
                  response=torch.from_numpy(response), response_index=torch.from_numpy(np.flatnonzero(response)),
                  pack=pack, routes=routes, routed=routed)


def _host(x: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor; a device tensor is copied back first (a wait: callers give host tensors)."""
    return (x if x.device.type == "cpu" else x.cpu()).numpy()
