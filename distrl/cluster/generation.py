"""Spreading a step's prompts over the rollout actors by load, and scoring each chunk as soon as it arrives.

Prompts are cut into chunks (about two per actor); an actor gets its next chunk when it returns the last one, so
a slow actor (longer responses, a busier node) simply takes fewer chunks. Each finished chunk goes straight to
reward tasks while the other actors keep generating.
"""

from __future__ import annotations

import math
from collections import deque

import ray

from distrl.cluster import rewards
from distrl.cluster.group import ActorGroup
from distrl.config import RewardConfig
from distrl.types import Prompt, Rollouts
from distrl.workers.rollout import RolloutWorker

CHUNKS_PER_ACTOR = 2


def reward_sample(prompt: Prompt) -> dict:
    """The dataset row handed to reward functions, with the answer under "answer" whatever `data.answer_key` is."""
    return prompt.sample if prompt.answer is None else {**prompt.sample, "answer": prompt.answer}


def generate(actors: ActorGroup[RolloutWorker], prompts: list[Prompt], reward: RewardConfig,
             ) -> tuple[Rollouts, list[ray.ObjectRef]]:
    """(rollouts in prompt order, the reward tasks scoring them in the same order; see `rewards.collect`)."""
    size = max(1, math.ceil(len(prompts) / (CHUNKS_PER_ACTOR * len(actors))))
    chunks = [list(range(i, min(i + size, len(prompts)))) for i in range(0, len(prompts), size)]
    queue, idle = deque(range(len(chunks))), list(range(len(actors)))
    pending: dict[ray.ObjectRef, tuple[int, int]] = {}
    results: dict[int, Rollouts] = {}
    scoring: list[list[ray.ObjectRef]] = [[] for _ in chunks]
    while queue or pending:
        while queue and idle:
            actor, chunk = idle.pop(), queue.popleft()
            ref = actors.call(actor, RolloutWorker.generate, [prompts[i] for i in chunks[chunk]], chunks[chunk])
            pending[ref] = (actor, chunk)
        (done,), _ = ray.wait(list(pending), num_returns=1)
        actor, chunk = pending.pop(done)
        idle.append(actor)
        part = results[chunk] = ray.get(done)
        items = [(prompts[g].text, text, reward_sample(prompts[g]))
                 for g, text in zip(part.group, part.response_texts, strict=True)]
        first_row = chunks[chunk][0] * len(part) // len(chunks[chunk])  # every prompt has the same sample count
        scoring[chunk] = rewards.submit(reward, items, first_row)
    return Rollouts.concat([results[c] for c in range(len(chunks))]), [ref for refs in scoring for ref in refs]


def generate_and_score(actors: ActorGroup[RolloutWorker], prompts: list[Prompt], reward: RewardConfig,
                       ) -> tuple[Rollouts, list[float], int]:
    """(rollouts in prompt order, one reward per sample, samples whose reward raised and scored 0): `generate`
    and `rewards.collect` in one call, for tools and tests that don't time the two apart."""
    rollouts, scoring = generate(actors, prompts, reward)
    return (rollouts, *rewards.collect(scoring))
