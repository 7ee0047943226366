"""Partial rollouts on the engine side (`loop.partial_rollouts`): samples continued one slice at a time.

A slice is at most `slice_tokens` more tokens of one sample, sampled from its prompt followed by the tokens it has
so far (its prefix: AReaL's resubmission of prompt + partial output), under whatever weights the engine serves
then. The prefix's tokens keep their log-probs and versions; each new token is stamped with the version that
sampled it, so a sample may span several versions. A sample that used its whole slice with room left is returned
unfinished (finish reason "partial") for the producer to carry over.

Each slice's randomness comes from the sample's own seed and the slice's index (`turn_seed` with the slice as the
turn): the first slice samples exactly what a one-turn episode does, and a sample is reproducible however its
slices were spread over engines and steps. One-turn samples only (the config refuses `env` and stop strings).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

from distrl.agents.trajectory import Budget, TurnSampler, drift, turn_seed
from distrl.types.rollouts import PARTIAL, Rollouts


def slice_length(budget: Budget, prompt: int, done: int, slice_tokens: int) -> tuple[int, int]:
    """(tokens this slice may draw, tokens the sample may still draw) for a sample of `prompt` prompt tokens that
    has `done` response tokens: one turn's budget (`max_new_tokens`, within the context) less what it has."""
    room = min(budget.max_new_tokens - done, budget.context - prompt - done)
    return min(slice_tokens, room), room


async def continue_samples(sampler: TurnSampler, budget: Budget, prefixes: Rollouts, samples: list[int],
                           seeds: list[int], slice_tokens: int, decode: Callable[[list[int]], str]) -> Rollouts:
    """One slice of each row of `prefixes` (row i: sample `samples[i]` of its prompt, whose request seed is
    `seeds[i]`; an empty response for a sample not started), all at once on `sampler`; returns the rows in order,
    each its prefix followed by the slice, finish reason "partial" when it is to be continued."""
    async def one(i: int) -> tuple[list[int], list[float], list[int], str, str, float, int]:
        prompt, done = prefixes.prompt_ids[i], prefixes.response_ids[i]
        take, room = slice_length(budget, len(prompt), len(done), slice_tokens)
        turn = await sampler.sample([*prompt, *done], take, turn_seed(seeds[i], samples[i], len(done) // slice_tokens))
        ids = [*done, *turn.token_ids]
        unfinished = turn.finish_reason == "length" and len(turn.token_ids) == take < room
        reason = PARTIAL if unfinished else turn.finish_reason
        text = "" if unfinished else decode(ids)  # a partial sample's text is not read
        return (ids, [*prefixes.rollout_logprobs[i], *turn.logprobs], [*prefixes.token_versions[i], *turn.versions],
                text, reason, turn.engine_s, drift(turn.prompt_ids, [*prompt, *done]))

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(prefixes))]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:  # the call's other slices leave the engine (as `run_episodes` does)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    out = Rollouts.empty()
    for i, (ids, logprobs, versions, text, reason, engine_s, drifted) in enumerate(results):
        before = prefixes.episodes[i]
        episode = replace(before, engine_s=before.engine_s + engine_s, drift=before.drift + drifted)
        out.add(prefixes.prompt_ids[i], ids, logprobs, [1] * len(ids), versions, text, reason, prefixes.group[i],
                episode, sampler.version)
    return out.validate()
