"""Weight fingerprints: what a rollout engine proves about the weights it serves after a push.

A fingerprint maps each HF tensor name to `(checksum, scale)`, computed from a fixed *sample* of the tensor: every
row, at `SAMPLE_COLUMNS` fixed columns (all of a 1-D tensor). The sample is an `[N, S]` float64 matrix; the checksum
weighs each entry by a fixed pseudo-random weight in [1, 2) that depends on its position, so a missing update, a
tensor loaded into the wrong place, swapped rows or a stale bucket all change it; `scale` (the same sum over
absolute values) sizes the tolerance.

Both sides build the same sample from what they hold: learner 0 from its own weights cast to the rollout dtype (what
it sent), the engine from its own parameters, or, for layers whose weights vLLM has repacked for its kernels (on
CPU the packed oneDNN form replaces the parameter), by running the layer's own GEMM on one-hot inputs, which returns
the sampled columns exactly as the kernel uses them. Equal inputs give bitwise-equal float64 sums; the tolerance
(`RTOL` of `scale`) only absorbs summation order on other hardware.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import numpy as np
import torch

SAMPLE_COLUMNS = 8
RTOL = 1e-12

Fingerprint = dict[str, tuple[float, float]]


class WeightMismatch(RuntimeError):
    """An engine serves weights other than those learner 0 pushed."""


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


def first_mismatch(expected: Fingerprint, served: Fingerprint) -> str | None:
    """None if `served` matches `expected` for every tensor of `expected`; otherwise what differs: the first tensor
    (in `expected`'s order) that is missing or has another checksum, and how many differ."""
    wrong = []
    for name, (checksum, scale) in expected.items():
        if name not in served:
            wrong.append(f"{name} is not among the tensors it serves")
        elif abs(served[name][0] - checksum) > RTOL * max(scale, served[name][1]):
            wrong.append(f"{name} differs (checksum {served[name][0]:.17g}, learner 0's {checksum:.17g})")
    if not wrong:
        return None
    return f"{wrong[0]}; {len(wrong)} of {len(expected)} tensors differ"


def check(expected: Fingerprint, served: Fingerprint, engine: str, version: int) -> None:
    """Raise WeightMismatch if engine `engine`, having loaded `version`, serves other weights than `expected`."""
    problem = first_mismatch(expected, served)
    if problem:
        raise WeightMismatch(f"{engine} serves weights other than learner 0's after loading version {version}: "
                             f"{problem} (cluster.verify_weights=false turns this check off)")


def served_fingerprint(model: torch.nn.Module) -> Fingerprint:
    """Fingerprint of the weights vLLM model `model` serves, under the HF names they
    were loaded from; runs inside the engine's worker.

    A linear layer's weight (and the LM head's) is sampled through the layer's own GEMM on one-hot inputs: on CPU
    vLLM packs it for oneDNN and drops the parameter, and on any device this reads what the kernel multiplies by.
    Fused layers (`qkv_proj`, `gate_up_proj`) are split back into their HF tensors by the model's
    `packed_modules_mapping` and the layer's output sizes. Rows past the vocabulary (vLLM pads the embedding and the
    LM head to a multiple of 64 rows), and the LM head's output sizes that count them, are left out."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    packed: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {})
    out: Fingerprint = {}
    with torch.no_grad():
        for prefix, module in model.named_modules():
            parent = prefix.rpartition(".")[0]
            if isinstance(module, LinearBase | ParallelLMHead):
                width = module.embedding_dim if isinstance(module, ParallelLMHead) else module.input_size_per_partition
                picked = columns(width)
                one_hot = torch.zeros(len(picked), width, dtype=module.weight.dtype, device=module.weight.device)
                one_hot[torch.arange(len(picked)), picked.to(one_hot.device)] = 1
                rows = module.quant_method.apply(module, one_hot).T  # [N, S]: W[:, picked]
                sizes = getattr(module, "output_partition_sizes", [rows.shape[0]])
                bias = getattr(module, "bias", None)
                if isinstance(module, ParallelLMHead):  # its output sizes count the padding rows too
                    rows = rows[:module.num_embeddings]
                    sizes = [module.num_embeddings]
                    bias = None if bias is None else bias[:module.num_embeddings]
                leaf = prefix.rpartition(".")[2]
                names = packed.get(leaf, [leaf])
                if len(names) != len(sizes):  # a fused layer under one HF name (e.g. Phi-3's qkv_proj)
                    names, sizes = [leaf], [rows.shape[0]]
                for i, (name, part) in enumerate(zip(names, rows.split(sizes), strict=True)):
                    full = f"{parent}.{name}" if parent else name
                    out[f"{full}.weight"] = of_sample(part)
                    if bias is not None:
                        out[f"{full}.bias"] = of_sample(sample(bias.split(sizes)[i]))
                continue
            for name, param in module.named_parameters(recurse=False):
                if isinstance(module, VocabParallelEmbedding):
                    param = param[:module.num_embeddings]  # noqa: PLW2901 - the same tensor without vLLM's padding
                out[f"{prefix}.{name}" if prefix else name] = of_sample(sample(param))
    return out
