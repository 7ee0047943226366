"""A mixture-of-experts policy's routers in the learner: their logits recorded during a forward pass, the figures
MoE users watch (`distrl.algo.router`), the load-balancing term `learner.router_aux_loss_coef` adds, and a forward
pass that replays given routes (rollout routing replay: `route`).

The routers are found as transformers records them (the model's `_can_record_outputs["router_logits"]`: the router
module class and which of its outputs are the logits, `[N, E]` over the N tokens of the packed row). Every token of
the row is routed, the prompt's too, and counts. A dense model has no router: nothing is recorded and nothing added.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from distrl.algo.router import expert_load, load_balancing_loss, max_violation, replayed_weights, router_entropy
from distrl.merging import Merge

Measured = dict[str, tuple[torch.Tensor, Merge]]


def _recorder(model: torch.nn.Module) -> Any:
    """transformers' recorder of `model`'s router logits (its inner models' too, under peft's wrappers), or None for
    a dense model."""
    for module in model.modules():
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None:
            return recorder
        if isinstance(module, torch.nn.ModuleList):  # the decoder layers: past the models that would name it
            return None
    return None


@contextmanager
def recorded_router_logits(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """A list that the forward passes run inside the block fill with every router's logits `[N, E]`, layer by layer
    (empty for a dense model). The hooks are gone after the block, so that a backward pass that recomputes the
    forward (gradient checkpointing) records nothing more."""
    recorder, logits = _recorder(model), list[torch.Tensor]()
    if recorder is None:
        yield logits
        return
    index = recorder.index or 0

    def keep(module, args, output):
        logits.append(output[index] if isinstance(output, tuple) else output)

    handles = [m.register_forward_hook(keep) for m in model.modules() if isinstance(m, recorder.target_class)]
    try:
        yield logits
    finally:
        for handle in handles:
            handle.remove()


def router_terms(logits: list[torch.Tensor], config: Any, coef: float, share: torch.Tensor | float,
                 ) -> tuple[torch.Tensor | None, Measured]:
    """The load-balancing term of one micro-batch (None when `coef` is 0), and its router figures: `moe/max_vio/max`
    and `moe/max_vio/mean` (MaxVio of each layer's expert load, the largest and the mean over layers),
    `moe/router_entropy` (mean over layers), `moe/aux_loss` (the Switch loss) and, with `coef`, `loss/router_aux`.
    `share`: the micro-batch's share of the mini-batch (its response tokens over the global count), so that the
    terms of every micro-batch and learner add up to the mini-batch's. `config`: the model's (its experts per token,
    `num_experts_per_tok`)."""
    top_k = config.num_experts_per_tok
    stacked = torch.stack(logits)  # [L, N, E]
    violation = max_violation(expert_load(stacked, top_k))
    aux = load_balancing_loss(stacked, top_k)
    figures: Measured = {"moe/max_vio/max": (violation.max(), Merge.MAX),
                         "moe/max_vio/mean": (violation.mean(), Merge.TOKEN_MEAN),
                         "moe/router_entropy": (router_entropy(stacked).mean(), Merge.TOKEN_MEAN),
                         "moe/aux_loss": (aux.detach(), Merge.TOKEN_MEAN)}
    if not coef:
        return None, figures
    term = coef * aux * share
    figures["loss/router_aux"] = (term.detach(), Merge.SUM)
    return term, figures


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """`model`'s routers (transformers' router modules), in the model's order of layers; none for a dense model."""
    recorder = _recorder(model)
    return [] if recorder is None else [m for m in model.modules() if isinstance(m, recorder.target_class)]


def route(model: torch.nn.Module, routes: torch.Tensor | None, routed: torch.Tensor | None = None) -> None:
    """From now until the next call, forward passes of `model` route each of their N tokens to the experts `routes`
    `[N, L, k]` gives it at each of the L routers (in the model's order), weighted by the router's current softmax
    over those experts (`replayed_weights`, renormalised as the model does): the routing decision is the given one,
    the routers still learn through the weights. Tokens where `routed` `[N]` (bool) is False, and every token with
    `routes` None, are routed by the router itself, exactly as without replay. Kept after the forward pass on
    purpose: a backward pass that recomputes the forward (gradient checkpointing) must route as the forward did.
    Raises ValueError unless the model has exactly L routers."""
    found = routers(model)
    if routes is not None and len(found) != routes.shape[1]:
        raise ValueError(f"routes of {routes.shape[1]} layers for a model with {len(found)} routers")
    for layer, router in enumerate(found):
        if routes is None:
            router.__dict__.pop("forward", None)
        else:
            router.forward = _replaying(router, routes[:, layer], routed)


def _replaying(router: Any, routes: torch.Tensor, routed: torch.Tensor | None) -> Any:
    """A forward for `router` (transformers' top-k router: `weight` `[E, H]`) that returns (logits, weights, routes)
    as its own does, with `routes` `[N, k]` in place of its top k where `routed` `[N]` says so (everywhere: None)."""
    renormalize = getattr(router, "norm_topk_prob", True)  # Mixtral's always renormalises; Qwen's says so

    def forward(hidden_states: torch.Tensor):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, router.weight.shape[1]), router.weight)
        chosen = routes.long()
        if routed is not None:  # the router's own choice, as its own forward makes it, where no route is given
            own = type(router).forward(router, hidden_states)[2]
            chosen = torch.where(routed[:, None], chosen, own)
        weights = replayed_weights(logits, chosen, renormalize)
        # Qwen's routers return their weights in the logits' dtype, Mixtral's in float32.
        return logits, weights.to(logits.dtype) if hasattr(router, "norm_topk_prob") else weights, chosen

    return forward
