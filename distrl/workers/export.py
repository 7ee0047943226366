"""The policy's weights as the rollout engines load them: HF names, the rollout dtype, in buckets.

Every learner takes part in every export call, so that a strategy whose learners each hold part of a tensor can
gather it; learner 0 returns the tensors and the others nothing. A tied output embedding (`lm_head.weight` that *is*
`model.embed_tokens.weight`, as in Qwen2.5) is sent once, under the input embedding's name: HF's `save_pretrained`
and vLLM's loaders read it from there.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from distrl.workers.model import DTYPES

Spec = list[tuple[str, tuple[int, ...]]]
"""One bucket: (HF name, shape) of each tensor in it."""


def exported(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every weight the engines load, in state-dict order; a tensor that another name already
    exported (tied embeddings) is left out."""
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in seen:
            continue
        seen.add(key)
        yield name, tensor


def specs(model: torch.nn.Module, bucket_bytes: int, dtype: str) -> list[Spec]:
    """Bucket layout of `exported(model)`: buckets of about `bucket_bytes` in `dtype` (a bigger tensor alone)."""
    item = torch.empty((), dtype=DTYPES[dtype]).element_size()
    layout: list[Spec] = [[]]
    size = 0
    for name, tensor in exported(model):
        if layout[-1] and size + tensor.numel() * item > bucket_bytes:
            layout.append([])
            size = 0
        layout[-1].append((name, tuple(tensor.shape)))
        size += tensor.numel() * item
    return layout


def bucket(model: torch.nn.Module, spec: Spec, dtype: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of one bucket `spec`, cast to `dtype`, contiguous on `device`."""
    state = model.state_dict()
    with torch.no_grad():
        return {name: state[name].detach().to(device, DTYPES[dtype]).contiguous() for name, _ in spec}
