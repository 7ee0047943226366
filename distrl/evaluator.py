"""Evaluation on held-out sets (`eval`), on the rollout engines: during training between steps (both loops, through
`distrl.loop.phases.evaluate`), and without training (`distrl eval`). Plain code: the caller says how to generate
and score.

`Evaluator` holds the sets' prompts, loaded once. `run` samples every set's prompts with the evaluation's settings
(`eval.sampling`) through a `generate` function, scores them (the set's reward function in reward tasks, or the
environment's reward), and returns the `eval/<set>/...` figures (`distrl.evaluation`) with the samples. In the
driver `generate` spreads the prompts over the rollout actors and waits through the producer, so in the
asynchronous loop the engines keep generating training chunks beside the evaluation's (whose tokens carry the
versions that sampled them: `eval/<set>/policy_version` is the oldest).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distrl.config import Config, EvalSetConfig
from distrl.data.prompts import load_prompts
from distrl.evaluation import EvalSample, figures
from distrl.types.prompt import Prompt
from distrl.types.rollouts import Rollouts
from distrl.workers.rewards import Scores

Generate = Callable[[list[Prompt], list[int]], Rollouts]
"""(prompts, their tickets) -> n episodes a prompt, sampled with the evaluation's settings."""
Score = Callable[[str, list[tuple[str, str, dict]]], Scores]
"""(reward function spec, (prompt text, completion, row) items) -> their scores."""


def eval_tickets(count: int) -> list[int]:
    """Tickets of an evaluation's prompts: negative, so that their seeds (and episode ids) are never a training
    prompt's, and the same at every evaluation (the same seeds: evaluations differ by the weights only)."""
    return [-(i + 1) for i in range(count)]


class Evaluator:
    """The held-out sets of `cfg.eval`, their prompts rendered and tokenized by `tokenizer` (at most `limit` each,
    in the set's order)."""

    def __init__(self, cfg: Config, tokenizer: Any):
        assert cfg.eval is not None
        self.cfg, self.eval = cfg, cfg.eval
        self.sets: list[tuple[EvalSetConfig, list[Prompt]]] = []
        for s in self.eval.sets:
            prompts, _ = load_prompts(s, tokenizer)
            self.sets.append((s, prompts[: s.limit] if s.limit else prompts))

    def due(self, step: int) -> bool:
        return self.eval.due(step, self.cfg.run.steps)

    def run(self, generate: Generate, score: Score) -> tuple[dict[str, float], dict[str, list[EvalSample]]]:
        """Evaluate every set: the figures of all of them, and each set's samples."""
        out: dict[str, float] = {}
        samples: dict[str, list[EvalSample]] = {}
        for s, prompts in self.sets:
            rollouts = generate(prompts, eval_tickets(len(prompts)))
            samples[s.name] = self._scored(s, prompts, rollouts, score)
            out.update(figures(s.name, samples[s.name], self.eval.sampling.n, self.eval.pass_threshold))
        return out, samples

    def _scored(self, s: EvalSetConfig, prompts: list[Prompt], rollouts: Rollouts, score: Score) -> list[EvalSample]:
        """One `EvalSample` per episode: its text is that of its sequences, its reward the environment's or the
        set's reward function's on the last sequence's response."""
        by_ticket = dict(zip(eval_tickets(len(prompts)), prompts, strict=True))
        episodes = rollouts.episode_bounds()
        prompt_of = [by_ticket[rollouts.group[a]] for a, _ in episodes]
        texts = ["".join(rollouts.response_texts[a:b]) for a, b in episodes]
        if self.cfg.env is not None:
            rewards = [float(rollouts.episodes[a].reward or 0.0) for a, _ in episodes]
            infos: list[dict[str, Any]] = [{} for _ in episodes]
        else:
            spec = s.reward or self.cfg.reward.function
            scores = score(spec, [(p.text, rollouts.response_texts[b - 1], p.row())
                                  for p, (_, b) in zip(prompt_of, episodes, strict=True)])
            rewards, infos = scores.rewards, scores.infos
        out = []
        seen: dict[int, int] = {}
        for k, (a, b) in enumerate(episodes):
            prompt = prompt_of[k]
            versions = [v for i in range(a, b) for v, m in zip(rollouts.token_versions[i], rollouts.loss_mask[i],
                                                                strict=True) if m] or [rollouts.policy_version[a]]
            out.append(EvalSample(prompt.index, prompt.text, seen.setdefault(prompt.index, 0), texts[k], rewards[k],
                                  infos[k], sum(len(rollouts.response_ids[i]) for i in range(a, b)),
                                  (min(versions), max(versions))))
            seen[prompt.index] += 1
        return out
