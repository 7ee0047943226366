"""Loading the policy / reference model with transformers, and the one forward pass both score with.

The forward pass returns the log-probs of the response tokens of `Sequences` after temperature scaling (the
same scaling vLLM applied when sampling), computed with the LM head in chunks by `distrl.algo.linear_logprobs`, so
no `[K, V]` logits are ever made. It runs on the sequences packed into one row, without padding
(`response_logprobs`, from a layout made on the host: `distrl.workers.training.packing`), so the model's attention must
keep them apart: models are loaded with distrl's `PACKED_ATTENTION`. `padded_response_logprobs` is the padded forward
pass it replaced, kept as the reference that packing is tested against and the baseline of
`bench/bench_learner_step.py`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from distrl.config import ModelConfig
from distrl.micro_batches import micro_batches
from distrl.types.batches import Sequences, on_host
from distrl.workers.device import to_device
from distrl.workers.model_files import DTYPES, resolve_model_path
from distrl.workers.training import moe, packed_attention
from distrl.workers.training.packed_attention import PACKED_ATTENTION
from distrl.workers.training.packing import Layout, host_layout
from distrl.workers.training.ulysses import SequenceSplit


def load_causal_lm(cfg: ModelConfig, dtype: str, path: str | None = None, device: str | torch.device = "cpu"):
    """An HF causal LM in `dtype` on `device`, in train mode off (callers switch it on), whose attention keeps
    packed sequences apart (`PACKED_ATTENTION`)."""
    from transformers import AutoModelForCausalLM

    # Typed as a Module: transformers wraps PreTrainedModel.to with functools.wraps, which mypy cannot bind.
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(cfg, path), dtype=DTYPES[dtype], trust_remote_code=cfg.trust_remote_code,
        attn_implementation=PACKED_ATTENTION,
    )
    return model.to(device).eval()


def padded_response_logprobs(model, batch: Sequences, temperature: float, with_entropy: bool = False):
    """`response_logprobs` on the padded batch `[B, P+T]` (log-probs of padding positions are left as computed).

    Positions are counted from the first real token, so left padding of the prompt does not shift them.
    The logits that predict response token t sit at sequence position P - 1 + t.
    """
    from distrl.algo import entropy_from_logits, token_logprobs

    p, t = batch.prompt_len, batch.response_len
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    kwargs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids,
                  use_cache=False)
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        # Only the last T + 1 positions (P - 1 ... P + T - 1): no [B, P, V] logits for the prompt.
        logits = model(**kwargs, logits_to_keep=t + 1).logits[:, :t]
    else:
        logits = model(**kwargs).logits[:, p - 1 : p - 1 + t]
    ids = batch.input_ids[:, p : p + t]
    logprobs = token_logprobs(logits, ids, temperature=temperature)
    entropy = entropy_from_logits(logits, temperature=temperature) if with_entropy else None
    return logprobs, entropy


def check_packed_attention(model) -> None:
    """Refuse a model whose attention would let the sequences of a packed row see each other."""
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if attention != PACKED_ATTENTION:
        raise ValueError(f"a packed forward pass puts many sequences in one row, which the model's attention "
                         f"({attention!r}) does not keep apart: load it with attn_implementation="
                         f"{PACKED_ATTENTION!r} (distrl.workers.training.model.load_causal_lm does)")


def packed_inputs(model, layout: Layout) -> dict:
    """The keyword arguments of `model`'s packed forward pass over `layout` (on the model's device), the attention
    told where the sequences are (`packed_attention.remember`: no read back from the device)."""
    check_packed_attention(model)
    packed_attention.remember(layout.position_ids, layout.pack)
    return dict(input_ids=layout.ids, position_ids=layout.position_ids, attention_mask=packed_attention.PACKED_ROWS,
                use_cache=False)


def response_logprobs(model, batch: Sequences, temperature: float, with_entropy: bool = False,
                      layout: Layout | None = None):
    """Log-probs of the response tokens under `model`: `[B, T]` float32, 0 on padding (and entropies `[B, T]` if
    asked), from one packed forward pass.

    The real tokens of the B rows are packed into one row of N tokens (`layout`, made on the host by
    `distrl.workers.training.packing.host_layout` and moved to the model's device; made here from `batch` when not
    given), with `position_ids` restarting at 0 per sequence and no attention mask. The model's attention
    (`PACKED_ATTENTION`, set when it is loaded) attends within each sequence, so every token sees exactly what it
    sees in the padded batch; no padding token reaches a linear layer and attention costs the sum of the squared
    lengths. Only the K hidden states that predict a response token reach the LM head, which is computed in chunks
    with the log-probs and entropies (`distrl.algo.linear_logprobs`: no `[K, V]` logits exist), inside the
    model's own forward (so sharding hooks on the root still run). Zero rows run the model on one token and return
    `[0, T]` outputs still connected to the graph (see `distrl.micro_batches`).
    """
    if layout is None:
        layout = host_layout(batch).to(batch.input_ids.device)
    logprobs, entropy = _head_outputs(model, layout, temperature, with_entropy)
    return layout.unpack(logprobs), None if entropy is None else layout.unpack(entropy)


def _head_outputs(model, layout: Layout, temperature: float, with_entropy: bool):
    """(log-probs `[K]`, entropies `[K]` or None) of `layout`'s response tokens under `model`, a mixture of experts
    replaying the layout's routes if it has any (`moe.route`: rollout routing replay, for the learner's update, its
    old log-probs and the reference alike): the decoder's K kept
    hidden states go through `linear_logprobs` in place of the LM head's forward (for this call only); a model
    that transforms its logits after the head (soft-capping, scaling) takes the plain head and `token_logprobs`.
    A split layout (sequence parallelism) runs this learner's slice and gathers the group's `[K]` (`Layout.gather`)."""
    from distrl.algo import entropy_from_logits, linear_logprobs, token_logprobs

    kwargs = packed_inputs(model, layout)
    moe.route(model, layout.routes, layout.routed)  # the layout's routes replayed, or the routers' own choice
    keep, targets = layout.predicts, layout.targets
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not hasattr(model, "get_decoder") or logit_transforms(model.config):
        logits = model(**kwargs).logits.flatten(0, 1)[keep]
        return (layout.gather(token_logprobs(logits, targets, temperature=temperature)),
                layout.gather(entropy_from_logits(logits, temperature=temperature) if with_entropy else None))
    outputs: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def kept_hidden_states(module, args, output):
        output.last_hidden_state = output.last_hidden_state.flatten(0, 1)[keep][None]  # [1, K, H]
        return output

    def chunked_head(hidden: torch.Tensor) -> torch.Tensor:  # [1, K, H] -> an empty [1, K, 0] "logits"
        weight = head.weight.to(hidden.dtype)  # one cast per forward; its gradient reaches the master weight
        bias = None if head.bias is None else head.bias.to(hidden.dtype)
        outputs.append(linear_logprobs(hidden[0], weight, targets, temperature, bias, with_entropy))
        return hidden.new_zeros(*hidden.shape[:2], 0)

    handle = model.get_decoder().register_forward_hook(kept_hidden_states)
    own = head.__dict__.get("forward")  # a forward set on the instance (a kernel library's patch) is put back
    head.forward = chunked_head
    try:
        model(**kwargs)
    finally:
        handle.remove()
        if own is None:
            del head.forward
        else:
            head.forward = own
    logprobs, entropy = outputs[0]
    return layout.gather(logprobs), layout.gather(entropy)


LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""Config fields of models that change their logits after the LM head (Gemma 2, Cohere, Granite, ...)."""


def logit_transforms(config) -> list[str]:
    """The fields of `config` by which its model transforms the head's logits (none for Llama, Qwen2, Mistral)."""
    return [name for name in LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 1, 1.0)]


@torch.no_grad()
def score_rows(score: Callable[[Sequences, Layout], torch.Tensor], batch: Sequences, groups: list[list[int]],
               device: str | torch.device, split: SequenceSplit | None = None) -> torch.Tensor:
    """A figure of every response token, `score(micro, layout) -> [b, T]`, computed over the micro-batches `groups`
    (row-index groups of `batch`, `distrl.micro_batches`; an empty group still makes its forward pass, a
    collective when sharded) on `device`: `[B, T]` float32 on CPU, 0 on padding, rows in the batch's order.
    `batch` stays on the host (a device batch is brought back once): each micro-batch `micro` is selected there and
    its packed `layout` made there and moved to the device without a wait; the figures come back in one copy at the
    end. With `split` (sequence parallelism) each layout is this learner's slice (`Layout.split`), and the figures
    the whole micro-batch's, gathered over the group."""
    batch = on_host(batch)
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=device)
    for rows in groups:
        index = torch.tensor(rows, dtype=torch.long)
        micro = batch.select(index)
        layout = host_layout(micro)
        out[to_device(index, device)] = score(micro, (layout.split(split) if split else layout).to(device)).float()
    return out.cpu().masked_fill(batch.response_mask == 0, 0.0)


def score_in_micro_batches(model, batch: Sequences, temperature: float, micro_batch_size: int,
                           max_tokens: int | None = None, device: str | torch.device | None = None,
                           split: SequenceSplit | None = None) -> torch.Tensor:
    """`response_logprobs` without gradients (`score_rows`) over micro-batches (`distrl.micro_batches.micro_batches`:
    by the token budget `max_tokens` when set, else `micro_batch_size` rows each), for `model` computing on `device`
    (default: where its first parameter is): `[B, T]` float32 on CPU, 0 on padding, rows in the batch's order. With
    `split`, this process's slice of each micro-batch (the k processes of its group score the same batch)."""
    batch = on_host(batch)
    groups = micro_batches(batch.attention_mask.numpy().sum(-1).tolist(), micro_batch_size, max_tokens)
    return score_rows(lambda micro, layout: response_logprobs(model, micro, temperature, layout=layout)[0], batch,
                      groups, device or next(model.parameters()).device, split)
