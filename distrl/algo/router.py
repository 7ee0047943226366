"""What a mixture of experts' routers do with a batch's tokens: each layer's expert load and its violation of a
uniform load, the routers' entropy, the load-balancing loss, and the routing weights of replayed routes.

Every function takes the router logits of L layers over the same N tokens, `[L, N, E]` (E experts), and the
number of experts each token is routed to, `top_k` (the k largest logits: the k largest softmax probabilities).

- Expert load and MaxVio: L. Wang et al., "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts"
  (2024), §4.1: MaxVio = (max_e Load_e - mean Load) / mean Load, Load_e the tokens a layer routed to expert e: the
  most-loaded expert's share over the uniform share, less 1 (the figure prime-rl logs as `max_vio`). 0 when every
  expert takes the same share; at most E / k - 1 (an expert takes at most one of each token's k slots).
- Load-balancing loss: W. Fedus et al., "Switch Transformers" (2021), eq. 4-6, as transformers computes it for
  Mixtral and Qwen3-MoE (`load_balancing_loss_func`): E * sum_e f_e P_e, where f_e is the share of every layer's
  routed slots that expert e took (summing to k) and P_e its mean router probability, both over all L * N
  (layer, token) pairs at once. k when balanced; its gradient reaches the routers through P alone.
"""

from __future__ import annotations

import torch


def expert_load(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """`[L, E]`: the share of each layer's N * k routed slots that each expert took (each row sums to 1)."""
    layers, tokens, experts = router_logits.shape
    chosen = router_logits.detach().topk(top_k, dim=-1).indices.reshape(layers, -1)  # [L, N k]
    counts = torch.zeros(layers, experts, device=router_logits.device).scatter_add_(
        1, chosen, torch.ones(chosen.shape, device=router_logits.device))
    return counts / max(tokens * top_k, 1)


def max_violation(load: torch.Tensor) -> torch.Tensor:
    """`[L]` MaxVio of each layer's expert load `[L, E]` (shares): the most-loaded expert's share over the uniform
    share 1 / E, less 1."""
    return load.max(dim=-1).values * load.shape[-1] - 1.0


def router_entropy(router_logits: torch.Tensor) -> torch.Tensor:
    """`[L]`: each layer's mean over its tokens of the entropy (nats) of the router's softmax over the experts; log E
    when the router is uniform, 0 when it is certain."""
    logp = router_logits.detach().float().log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(dim=-1).mean(dim=-1)


def load_balancing_loss(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The Switch Transformer load-balancing loss of all L layers' routing together (a scalar with gradient)."""
    experts = router_logits.shape[-1]
    probs = router_logits.float().softmax(dim=-1).flatten(0, 1)  # [L N, E]
    routed = expert_load(router_logits, top_k).mean(dim=0) * top_k  # f_e: [E], summing to k
    return experts * (routed * probs.mean(dim=0)).sum()


def replayed_weights(router_logits: torch.Tensor, routes: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """`[N, k]` float32 routing weights of tokens routed to the given experts `routes` `[N, k]` (rollout routing
    replay: the engine's routing decision, the current router's weights): the router's softmax over all E experts
    `[N, E]` at those experts, divided by their sum when the model renormalises its top k (Mixtral; Qwen3-MoE with
    `norm_topk_prob`). W. Ma et al., "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
    Routers" (2025). The gradient reaches the router through these weights; the choice of experts has none."""
    weights = router_logits.float().softmax(dim=-1).gather(-1, routes)
    return weights / weights.sum(dim=-1, keepdim=True) if renormalize else weights
