"""What one worker of a vLLM engine serves, read back from its model, under the HF names the weights were loaded
from and the region of each HF tensor the worker holds (`distrl.workers.weights.fingerprint.Region`): the whole
tensor at TP 1; at TP k, a column-parallel projection's rank-r block of output rows, a row-parallel projection's
block of input columns, a vocabulary shard, a replicated tensor whole. Runs inside the worker (the engine's worker
extension, `distrl.workers.rollout.worker_extension`).

A linear layer's weight (and the LM head's) is sampled through the layer's own GEMM on one-hot inputs: on CPU vLLM
packs it for oneDNN and drops the parameter, and on any device this reads what the kernel multiplies by. Fused
layers (`qkv_proj`, `gate_up_proj`) are split back into their HF tensors by the model's `packed_modules_mapping` and
the layer's output sizes per rank. Rows past the vocabulary (vLLM pads the embedding and the LM head to a multiple
of 64 rows, per rank), and the LM head's output sizes that count them, are left out.

A mixture of experts' layer serves its router (`mlp.gate`, a replicated linear layer read as the others) and its
experts, which vLLM stacks as transformers does (`w13_weight [E, 2I, H]`, each expert's gate rows then its up rows;
`w2_weight [E, H, I]`): they are served under the HF names of those stacks, `mlp.experts.gate_up_proj` and
`mlp.experts.down_proj`, each expert a row of the sample (`distrl.workers.rollout.served_experts`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from distrl.workers.rollout import engine_names
from distrl.workers.rollout.served_experts import experts, is_experts
from distrl.workers.weights.fingerprint import Fingerprint, Held, Region, columns, key, of_sample, sample

Served = Iterator[tuple[str, Region, torch.Tensor]]
"""(HF name, region, `[N, S]` sample of what the worker holds of it)."""


def served_fingerprint(model: torch.nn.Module, model_type: str) -> Fingerprint:
    """Fingerprint of what `model` (a vLLM model of HF `model_type`, in its worker) serves, keyed by
    `fingerprint.key(name, region)`."""
    return {key(name, region): of_sample(values) for name, region, values in served(model, model_type)}


def served_regions(model: torch.nn.Module, model_type: str) -> Held:
    """The regions of HF tensors that `model`'s worker holds, (HF name, region) each (its layout: fixed once built)."""
    return [(name, region) for name, region, _ in served(model, model_type)]


@torch.no_grad()
def served(model: torch.nn.Module, model_type: str) -> Served:
    """(HF name, region, sample) of every tensor `model` (of HF `model_type`) serves (see the module's docstring),
    under the learners' names (`engine_names`)."""
    for name, region, values in _served(model):
        yield engine_names.to_learner(name, model_type), region, values


def _served(model: torch.nn.Module) -> Served:
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    packed: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {})
    for prefix, module in model.named_modules():
        parent, _, leaf = prefix.rpartition(".")
        if isinstance(module, ParallelLMHead):
            yield from _vocab_head(module, prefix)
        elif is_experts(module):
            yield from experts(module, prefix)
        elif isinstance(module, LinearBase):
            yield from _linear(module, parent, packed.get(leaf, [leaf]))
        else:
            for name, param in module.named_parameters(recurse=False):
                region: Region = None
                if isinstance(module, VocabParallelEmbedding):  # its rows of the vocabulary, without the padding
                    param, region = _vocabulary_rows(module, param)  # noqa: PLW2901 - the rows actually served
                yield f"{prefix}.{name}" if prefix else name, region, sample(param)


def through_kernel(module: Any, width: int) -> torch.Tensor:
    """`[N, S]`: the columns `columns(width)` of `module`'s weight, as its own GEMM multiplies by them."""
    picked = columns(width)
    one_hot = torch.zeros(len(picked), width, dtype=module.weight.dtype, device=module.weight.device)
    one_hot[torch.arange(len(picked)), picked.to(one_hot.device)] = 1
    return module.quant_method.apply(module, one_hot).T


def _linear(module: Any, parent: str, names: list[str]) -> Served:
    """A linear layer's weight (and bias), split into its HF tensors, each with this rank's region."""
    width = getattr(module, "input_size_per_partition", None) or module.input_size
    rows = through_kernel(module, width)
    sizes = list(getattr(module, "output_partition_sizes", [rows.shape[0]]))
    bias = getattr(module, "bias", None)
    tp = getattr(module, "tp_size", 1)
    if len(names) != len(sizes):  # a fused layer under one HF name (e.g. Phi-3's qkv_proj)
        if tp > 1 and len(sizes) > 1:
            raise RuntimeError(
                f"{parent}: {module.__class__.__name__} fuses {len(sizes)} projections under one HF tensor, which "
                f"tensor parallelism cuts into several separate blocks: its per-worker fingerprint is not supported "
                f"(cluster.verify_weights=false turns the check off)")
        names, sizes = names[:1], [rows.shape[0]]
    weight_regions, bias_regions = linear_regions(module, sizes)
    for i, (name, part) in enumerate(zip(names, rows.split(sizes), strict=True)):
        full = f"{parent}.{name}" if parent else name
        yield f"{full}.weight", weight_regions[i], part
        if bias is not None:
            yield f"{full}.bias", bias_regions[i], sample(bias.split(sizes)[i])


def linear_regions(module: Any, sizes: list[int]) -> tuple[list[Region], list[Region]]:
    """The regions of each of a linear layer's HF weights, and of its biases, that this rank holds."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    whole: list[Region] = [None] * len(sizes)
    tp, rank = getattr(module, "tp_size", 1), getattr(module, "tp_rank", 0)
    if tp == 1:
        return whole, whole
    if isinstance(module, RowParallelLinear):  # a block of input columns; the bias is added whole, after the reduce
        width = module.input_size_per_partition
        return [(1, rank * width, width)] * len(sizes), whole
    if isinstance(module, ColumnParallelLinear):  # a block of each projection's output rows
        # QKV's key and value heads, when there are fewer of them than ranks, are replicated over
        # `num_kv_head_replicas` consecutive ranks.
        replicas = [1] * len(sizes)
        if isinstance(module, QKVParallelLinear):
            replicas[1:] = [module.num_kv_head_replicas] * (len(sizes) - 1)
        regions: list[Region] = [(0, (rank // r) * size, size) for size, r in zip(sizes, replicas, strict=True)]
        return regions, regions
    return whole, whole  # replicated on every rank (ReplicatedLinear, a MoE router)


def _vocabulary_rows(module: Any, param: torch.Tensor) -> tuple[torch.Tensor, Region]:
    """A vocabulary-parallel table's rows that stand for vocabulary entries (this rank's shard, no padding), and
    their region of the HF tensor (None at TP 1)."""
    shard = module.shard_indices
    rows = param[:shard.num_org_elements]
    region: Region = None if module.tp_size == 1 else (0, shard.org_vocab_start_index, shard.num_org_elements)
    return rows, region


def _vocab_head(module: Any, prefix: str) -> Served:
    """The LM head's weight (and bias) through its kernel: this rank's vocabulary rows."""
    rows, region = _vocabulary_rows(module, through_kernel(module, module.embedding_dim))
    yield f"{prefix}.weight", region, rows
    bias = getattr(module, "bias", None)
    if bias is not None:
        yield f"{prefix}.bias", region, sample(_vocabulary_rows(module, bias)[0])
