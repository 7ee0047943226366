"""The policy's weights as the rollout engines load them: HF names, the rollout dtype, in buckets.

Every learner takes part in every export call, so that a strategy whose learners each hold part of a tensor can
gather it; learner 0 returns the tensors and the others nothing. A tied output embedding (`lm_head.weight` that *is*
`model.embed_tokens.weight`, as in Qwen2.5) is sent under both names: vLLM's CPU build repacks the LM head apart from
the embedding, so a head that is not sent keeps serving the old weights (measured: log-probs off by 1.16 and the
fingerprint check failing on `lm_head.weight`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping

import torch

from distrl.workers.model_files import DTYPES

Spec = list[tuple[str, tuple[int, ...]]]
"""One bucket: (HF name, shape) of each tensor in it."""


def state(model: torch.nn.Module) -> Mapping[str, torch.Tensor]:
    """{HF name: tensor} of every weight the engines load, in state-dict order, tied ones under each name; of a model
    with adapters, the adapter tensors (PEFT names), or with `learner.lora.serve: merged` the adapted blocks merged
    (`lora.Merged`, each made when read)."""
    from distrl.workers.training import lora

    if not lora.is_adapted(model):
        return model.state_dict()
    return lora.Merged(model) if lora.serves_merged(model) else dict(lora.adapter_tensors(model))


def exported(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight the engines load (`state`), in order."""
    yield from state(model).items()


def specs(model: torch.nn.Module, bucket_bytes: int, dtype: str | torch.dtype) -> list[Spec]:
    """Bucket layout of `exported(model)`: buckets of about `bucket_bytes` in `dtype` (a bigger tensor alone). Sharded
    tensors count by their full shapes, so every learner gets the same layout without communication."""
    item = torch.empty((), dtype=DTYPES[dtype] if isinstance(dtype, str) else dtype).element_size()
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
    tensors = state(model)
    with torch.no_grad():
        return {name: tensors[name].detach().to(device, DTYPES[dtype]).contiguous() for name, _ in spec}


class Bucket(dict):
    """A bucket of tensors `{HF name: tensor}` that pickles each tensor as its raw bytes, a uint8 NumPy view, which
    pickle protocol 5 hands over out of band. Ray's object store then gives a reader those bytes mapped from its
    shared memory: an engine that fetches a bucket holds no copy of it in its own memory, where a pickled torch
    tensor is rebuilt through an in-band bytes copy and then a storage copy (two buckets of the engine's heap,
    measured by `bench/bench_push_memory.py`). In one process it is a plain dict.

    The rebuilt tensors are read-only views of that memory: the engines only copy them into their weights."""

    def __reduce_ex__(self, protocol):
        return _rebuild_bucket, ([(name, _raw_bytes(t), str(t.dtype).removeprefix("torch."), tuple(t.shape))
                                  for name, t in self.items()],)


def _raw_bytes(tensor: torch.Tensor):
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _rebuild_bucket(items: list) -> Bucket:
    with warnings.catch_warnings():  # the object store's buffers are read-only, and so are these tensors
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return Bucket({name: torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)
                       for name, raw, dtype, shape in items})
