"""Evaluation figures of a held-out set, and its samples as a person reads them. Plain Python, no Ray, no torch.

For P prompts with n samples each, a sample is *correct* when its reward is at least the threshold
(`eval.pass_threshold`). Figures, under `eval/<set>/`:

    accuracy                 mean reward over all samples (mean@n: the mean of the n samples, over prompts)
    pass@k (k = 1..n)        the unbiased estimator of Chen et al. 2021 (HumanEval): per prompt with c of n correct,
                             1 - C(n - c, k) / C(n, k), the chance that k of its n samples drawn without replacement
                             hold a correct one; averaged over prompts
    maj@n                    majority vote: per prompt the most frequent extracted answer (the reward's
                             `info["answer"]`; ties go to the answer seen first), correct when its samples are;
                             only when the reward extracts answers
    response_length/mean     response tokens per sample
    samples                  how many samples were scored
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k of one prompt: `correct` of its `n` samples are correct."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= correct <= n and 1 <= k <= n, got n={n}, correct={correct}, k={k}")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


@dataclass(frozen=True)
class EvalSample:
    """One evaluated sample: its prompt (index in the set, text), sample number, completion, reward, the reward's
    info (the answer extracted, ...), response tokens, and the policy versions that sampled it (oldest, newest)."""

    prompt_index: int
    prompt: str
    sample: int
    completion: str
    reward: float
    info: dict[str, Any]
    tokens: int
    versions: tuple[int, int]

    def as_row(self) -> dict[str, Any]:
        return {"prompt_index": self.prompt_index, "sample": self.sample, "prompt": self.prompt,
                "completion": self.completion, "reward": self.reward, "answer": self.info.get("answer"),
                "info": self.info, "tokens": self.tokens, "policy_version": list(self.versions)}


def _majority_correct(samples: list[EvalSample], threshold: float) -> bool | None:
    answered = [s for s in samples if s.info.get("answer") is not None]
    if not answered:
        return None
    keys = [json.dumps(s.info["answer"], sort_keys=True) for s in answered]
    winner, _ = Counter(keys).most_common(1)[0]  # ties: the answer seen first (most_common is stable)
    return any(s.reward >= threshold for s, key in zip(answered, keys, strict=True) if key == winner)


def figures(name: str, samples: list[EvalSample], n: int, threshold: float) -> dict[str, float]:
    """`eval/<name>/...` figures of `samples` (n per prompt)."""
    by_prompt: dict[int, list[EvalSample]] = {}
    for s in samples:
        by_prompt.setdefault(s.prompt_index, []).append(s)
    bad = {i: len(group) for i, group in by_prompt.items() if len(group) != n}
    if bad:
        raise ValueError(f"eval set {name}: every prompt needs {n} samples, prompts {sorted(bad)} have {bad}")
    prefix = f"eval/{name}/"
    out = {prefix + "accuracy": statistics.fmean(s.reward for s in samples),
           prefix + "response_length/mean": statistics.fmean(s.tokens for s in samples),
           prefix + "samples": float(len(samples)),
           prefix + "policy_version": float(min(s.versions[0] for s in samples)),
           prefix + "policy_version_max": float(max(s.versions[1] for s in samples))}
    correct = [sum(s.reward >= threshold for s in group) for group in by_prompt.values()]
    for k in range(1, n + 1):
        out[f"{prefix}pass@{k}"] = statistics.fmean(pass_at_k(n, c, k) for c in correct)
    if n > 1:
        out[f"{prefix}mean@{n}"] = out[prefix + "accuracy"]
    votes = [_majority_correct(group, threshold) for group in by_prompt.values()]
    if any(v is not None for v in votes):
        out[f"{prefix}maj@{n}"] = statistics.fmean(bool(v) for v in votes)
    return out


def write_samples(path: Path, samples: list[EvalSample]) -> None:
    """Every sample as a JSON line (written to a temporary file, then renamed: a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for s in samples:
            f.write(json.dumps(s.as_row()) + "\n")
    tmp.replace(path)
