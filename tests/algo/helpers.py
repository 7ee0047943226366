"""Random `[B, T]` batches for the loss tests: ragged masks (including an empty row), log-probs near each other."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from distrl.algo import LossInputs


def ragged_mask(lengths: list[int], t: int) -> torch.Tensor:
    """Right-padded 0/1 float mask `[B, T]` with the given response lengths."""
    return (torch.arange(t) < torch.tensor(lengths).unsqueeze(-1)).float()


def random_inputs(lengths: list[int], t: int, seed: int = 0, spread: float = 0.3) -> LossInputs:
    """LossInputs with every optional field set; `logprobs` and `entropy` are leaves that require grad.

    Log-probs differ by ~`spread` so that some PPO ratios clip and some correction weights truncate.
    One advantage per sequence (as GRPO produces), constant over its tokens. `cov_selected` marks a random quarter
    of the tokens (the covariance losses' input; `tests/algo/test_covariance.py` tests how it is chosen).
    """
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    mask = ragged_mask(lengths, t)
    old = -torch.rand(b, t, generator=g) * 3 - 0.1
    logprobs = (old + spread * torch.randn(b, t, generator=g)).requires_grad_()
    rollout = old + spread * torch.randn(b, t, generator=g)
    ref = old + spread * torch.randn(b, t, generator=g)
    advantages = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    entropy = (torch.rand(b, t, generator=g) * 2).requires_grad_()
    selected = torch.rand(b, t, generator=g) < 0.25
    return LossInputs(logprobs=logprobs, old_logprobs=old, advantages=advantages, mask=mask * 1.0,
                      rollout_logprobs=rollout, ref_logprobs=ref, entropy=entropy, cov_selected=selected)


def rows(inputs: LossInputs, index: slice, **normalisers) -> LossInputs:
    """Rows `index` of every tensor (leaves stay connected to the originals through the slice)."""
    def sl(x):
        return None if x is None else x[index]

    return LossInputs(logprobs=sl(inputs.logprobs), old_logprobs=sl(inputs.old_logprobs),
                      advantages=sl(inputs.advantages), mask=sl(inputs.mask),
                      rollout_logprobs=sl(inputs.rollout_logprobs), ref_logprobs=sl(inputs.ref_logprobs),
                      entropy=sl(inputs.entropy), cov_selected=sl(inputs.cov_selected), **normalisers)


@st.composite
def padded_batch(draw):
    """(lengths, T, a fill per input tensor for the padding: NaN, +-inf, +-1e30, ..., a seed) for property tests that
    padding cannot change a loss."""
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, t), min_size=b, max_size=b))
    garbage = st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -1e30, 0.0, 50.0, -50.0])
    fills = {name: draw(garbage) for name in ("logprobs", "old_logprobs", "advantages", "rollout_logprobs",
                                              "ref_logprobs", "entropy")}
    fills["cov_selected"] = draw(st.booleans())
    return lengths, t, fills, draw(st.integers(0, 2**16))
