"""`LossInputs`: the per-token inputs of the policy loss, and the checks that the config's terms have theirs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distrl.config import COVARIANCE_TYPES, LossConfig

TENSORS = ("logprobs", "old_logprobs", "advantages", "rollout_logprobs", "ref_logprobs", "entropy", "cov_selected")


@dataclass
class LossInputs:
    """Per-token inputs `[B, T]` of `compute_loss`, and the global normalisers of a sharded batch.

    logprobs          log pi(o_t) under the current policy; the only input that carries gradient
    old_logprobs      log pi_old(o_t): the trainer before this update (the PPO ratio's denominator)
    advantages        A_t
    mask              1 on response tokens that count, 0 on padding
    rollout_logprobs  log pi_rollout(o_t) from the sampler (vLLM); needed by `loss.correction`
    ref_logprobs      log pi_ref(o_t); needed by a KL term in the loss
    entropy           H_t of the current policy (carries gradient); needed by `loss.entropy_coef > 0`
    cov_selected      1 (or True) on the tokens the whole batch selected by covariance, 0 elsewhere; needed by
                      `loss.policy.type` clip_cov and kl_cov (`distrl.algo.covariance_selection`, made on the whole
                      batch before it is split, then split with it)
    num_tokens        valid tokens in the whole (global) batch; null means this shard's own count
    num_seqs          non-empty sequences in the whole batch; null means this shard's own count
    norm_len          seq_mean_token_sum_norm's divisor; overrides `loss.policy.norm_len`; both null means T
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    rollout_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    cov_selected: torch.Tensor | None = None
    num_tokens: float | None = None
    num_seqs: float | None = None
    norm_len: int | None = None

    def validate(self) -> LossInputs:
        if self.logprobs.dim() != 2:
            raise ValueError(f"LossInputs.logprobs must be [B, T], got shape {tuple(self.logprobs.shape)}")
        for name in (*TENSORS, "mask"):
            x = getattr(self, name)
            if x is not None and x.shape != self.logprobs.shape:
                raise ValueError(f"LossInputs.{name} is {tuple(x.shape)}, logprobs is {tuple(self.logprobs.shape)}")
        return self


def require_inputs(inputs: LossInputs, cfg: LossConfig) -> None:
    """Fail early, naming the config field that asks for a missing input."""
    if cfg.correction is not None and inputs.rollout_logprobs is None:
        raise ValueError("loss.correction is set but LossInputs.rollout_logprobs is None: pass the sampler's "
                         "log-probs, or set loss.correction to null")
    if kl_in_loss(cfg) and inputs.ref_logprobs is None:
        raise ValueError(f"loss.kl.coef ({cfg.kl.coef}) > 0 with loss.kl.target 'loss' needs "
                         "LossInputs.ref_logprobs (reference-model log-probs)")
    if cfg.policy.type in COVARIANCE_TYPES and inputs.cov_selected is None:
        raise ValueError(f"loss.policy.type '{cfg.policy.type}' acts on the tokens the whole batch selects by "
                         "covariance: pass LossInputs.cov_selected (distrl.algo.covariance_selection over the whole "
                         "batch, before it is split into micro-batches or shards)")
    if cfg.entropy_coef > 0 and inputs.entropy is None:
        raise ValueError(f"loss.entropy_coef ({cfg.entropy_coef}) > 0 needs LossInputs.entropy "
                         "(see distrl.algo.entropy_from_logits)")


def kl_in_loss(cfg: LossConfig) -> bool:
    return cfg.kl.target == "loss" and cfg.kl.coef > 0
