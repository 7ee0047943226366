"""How a rollout engine samples: one turn's vLLM `SamplingParams` (from `rollout.sampling`, or an evaluation's
settings over it) and the seed of each prompt's request, a pure function of the run's seed and the prompt's ticket,
so that a sample does not depend on which engine drew it or when."""

from __future__ import annotations

import hashlib
from typing import Any

from distrl.config import EvalSamplingConfig, SamplingConfig


def sampling_params(s: SamplingConfig, max_tokens: int, seed: int) -> Any:
    """One turn's `SamplingParams`. vLLM detokenizes every sampled token, and every log-prob's token, as it goes: on
    a small model that costs more than the forward passes, so only stop strings get it (the turn is decoded once at
    its end otherwise). Flat log-probs hold one float per position (logprobs=0: the sampled token's) instead of a
    dict per position; deltas let each token carry the version that sampled it."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=max_tokens,
                          stop=s.stop or None, logprobs=0, flat_logprobs=True, detokenize=bool(s.stop), seed=seed,
                          output_kind=RequestOutputKind.DELTA)


def eval_sampling(rollout: SamplingConfig, e: EvalSamplingConfig) -> SamplingConfig:
    """The rollout's sampling settings with an evaluation's temperature (0: greedy), top-p and turn length."""
    return rollout.model_copy(update={"temperature": e.temperature, "top_p": e.top_p,
                                      "max_new_tokens": e.max_new_tokens or rollout.max_new_tokens})


def request_seed(seed: int, ticket: int) -> int:
    """The sampling seed of the request for prompt `ticket` in a run whose sampling seed is `seed`: 56 bits of a
    hash of both, so that neighbouring tickets get unrelated streams. vLLM gives the request's j-th sample seed + j
    (n > 1 is split into child requests), which stays below 2**63."""
    digest = hashlib.sha256(f"distrl-sample:{seed}:{ticket}".encode()).digest()
    return int.from_bytes(digest[:7], "little")
