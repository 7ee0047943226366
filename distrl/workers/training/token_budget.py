"""`max_tokens_per_micro_batch: auto`: the token budget of one forward pass, from the model's shape and the memory
the device has left once the model is built.

A packed micro-batch's memory is its activations, about linear in its tokens (attention is FlashAttention's or
sdpa's, never an `[N, N]` score matrix; the LM head is chunked, `linear_logprobs`). What one decoder layer keeps
for its backward pass per token, in bfloat16, with hidden size h and MLP width i, is about 24 h + 10 i bytes: the
inputs of its norms, projections, rotary embedding, attention and of the SwiGLU's three matrices (Korthikanti et
al. 2022 count 34 h for a GPT layer with a 4h MLP). On one H200 the 0.5B learner's step measured 1.9 MB per token
against this formula's 1.7 MB (24 layers, h 896, i 4864): `ACTIVATION_SAFETY` covers the difference and the
allocator's fragmentation. With gradient checkpointing a layer keeps only its input (2 h bytes) and one layer at a
time is recomputed; a forward pass without gradients (scoring) holds about two layers' worth at a time.

The budget is what remains of the free memory after what training will still allocate (float32 gradients and
AdamW's two moments, 12 bytes per trained parameter on this learner, and the compute-dtype casts of the weights, 2
bytes per parameter), what other parts sharing the device will still allocate while this one computes (`reserved`:
in a hybrid actor, the learner's AdamW moments while the reference scores) and a margin (`MARGIN_FRACTION` of the
device and `MARGIN_BYTES`), divided by the bytes per token, capped at `MAX_TOKENS`. With sequence parallelism
(`learner.sequence_parallel_size` k) a micro-batch's tokens are split over k learners, each holding the activations
of 1/k of them (`distrl.workers.training.ulysses`): the budget of a micro-batch is k times one learner's. It is
resolved once every part that shares the device is built (a hybrid actor resolves its learner's and reference's
after its engine, asleep).
docs/learner-performance.md says how to choose a budget by hand.
"""

from __future__ import annotations

import torch

ACTIVATION_SAFETY = 1.25
"""Measured bytes per token over the formula's, rounded up (module docstring)."""

MARGIN_FRACTION, MARGIN_BYTES = 0.08, 2 * 2**30
"""Memory left unplanned: the CUDA context, NCCL's buffers, the allocator's fragmentation, the head's chunks."""

MAX_TOKENS = 65536
"""The largest automatic budget: beyond it a pass gains little (the GPU is busy) and the first step waits long."""

MIN_TOKENS = 512
"""Below this the activations of even short sequences do not fit: `auto` refuses rather than run out of memory."""

CPU_TOKENS = 8192
"""`auto` on the CPU, where memory is seldom the limit and a pass of ~8k tokens keeps the cores busy."""


def layer_bytes_per_token(config) -> float:
    """Bytes one decoder layer keeps per token for its backward pass in bfloat16 (module docstring)."""
    hidden = config.hidden_size
    width = getattr(config, "intermediate_size", None) or 4 * hidden
    return 24 * hidden + 10 * width


def bytes_per_token(config, training: bool, checkpointing: bool) -> float:
    """Activation bytes per token of one forward (and backward) pass of a model of `config`."""
    layer = layer_bytes_per_token(config) * ACTIVATION_SAFETY
    if not training:
        return 2 * layer
    if checkpointing:
        return config.num_hidden_layers * 2 * config.hidden_size + layer
    return config.num_hidden_layers * layer


GRADIENT_BYTES, ADAMW_BYTES = 4, 8
"""Bytes per trained parameter of its float32 gradient and of AdamW's two float32 moments."""


def auto_token_budget(model: torch.nn.Module, device: str, *, training: bool, checkpointing: bool = False,
                      field: str = "learner.max_tokens_per_micro_batch", reserved: float = 0.0,
                      sequence_parallel: int = 1) -> int:
    """The `auto` budget of `model` on `device` (module docstring), called once the model and every other part
    sharing the device are built (their weights are then in the free memory) and before its first optimizer step;
    `reserved`: bytes the other parts will still allocate while this one computes; `field` names the setting in
    errors; `sequence_parallel`: the learners that share each micro-batch, each holding 1/k of its tokens."""
    if torch.device(device).type != "cuda":
        return CPU_TOKENS * sequence_parallel
    config = getattr(model, "get_base_model", lambda: model)().config
    free, total = torch.cuda.mem_get_info()
    params = sum(_local_numel(p) for p in model.parameters())
    trained = trained_parameters(model) if training else 0
    allocated = (GRADIENT_BYTES + ADAMW_BYTES) * trained + 2 * params + reserved
    tokens = int((free - allocated - MARGIN_FRACTION * total - MARGIN_BYTES) / bytes_per_token(config, training,
                                                                                             checkpointing))
    if tokens < MIN_TOKENS:
        others = f" and the other parts on the device {reserved / 2**30:.1f} GiB" if reserved else ""
        raise ValueError(
            f"{field} 'auto': the GPU has {free / 2**30:.1f} GiB free, and the model's gradients, AdamW state and "
            f"compute-dtype weights will take {(allocated - reserved) / 2**30:.1f} GiB of it{others}, which leaves "
            f"room for fewer than {MIN_TOKENS} tokens of activations: shard the model (strategy: fsdp, with "
            f"cpu_offload), turn gradient_checkpointing on, or set {field} to a number")
    return min(tokens, MAX_TOKENS) * sequence_parallel


def trained_parameters(model: torch.nn.Module) -> int:
    """Elements of `model`'s trained parameters held on this device."""
    return sum(_local_numel(p) for p in model.parameters() if p.requires_grad)


def _local_numel(param: torch.Tensor) -> int:
    """Elements of `param` held on this device (a sharded parameter's shard)."""
    local = getattr(param, "to_local", None)
    return local().numel() if callable(local) else param.numel()
