"""The prompt stream (`distrl.data.stream`): deterministic per seed, a fresh permutation each epoch, tickets across
epochs, and a resume that serves exactly the prompts drawn but not consumed."""

from __future__ import annotations

import json

import pytest

from distrl.data.stream import PromptStream
from distrl.types.prompt import Prompt


def make_prompts(n: int) -> list[Prompt]:
    return [Prompt(index=i, text=str(i), prompt_ids=[i]) for i in range(n)]


def take(stream: PromptStream, n: int) -> list[int]:
    return [p.index for _, p in stream.take(n)]


def test_stream_is_deterministic_per_seed():
    prompts = make_prompts(10)
    assert take(PromptStream(prompts, seed=3), 24) == take(PromptStream(prompts, seed=3), 24)
    assert take(PromptStream(prompts, seed=3), 24) != take(PromptStream(prompts, seed=4), 24)


def test_each_epoch_is_a_fresh_permutation():
    stream = PromptStream(make_prompts(12), seed=0)
    epochs = [take(stream, 12) for _ in range(3)]
    assert all(sorted(e) == list(range(12)) for e in epochs)
    assert epochs[0] != list(range(12)) and len({tuple(e) for e in epochs}) == 3
    assert stream.epoch_of(35) == 2


def test_tickets_number_the_stream_across_epochs():
    stream = PromptStream(make_prompts(5), shuffle=False)
    assert [(t, p.index) for t, p in stream.take(7)] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, 0), (6, 1)]
    assert stream.prompt(12).index == 2 and stream.epoch_of(12) == 2


def test_resume_serves_exactly_the_drawn_but_unconsumed_prompts():
    prompts = make_prompts(7)
    original = PromptStream(prompts, seed=11)
    drawn = original.take(12)  # into the second epoch
    # Trained out of order, as the asynchronous mode does: tickets 0-4, 6 and 9; 5, 7, 8, 10, 11 still in flight.
    original.consume([0, 1, 2, 3, 4, 6, 9])
    state = json.loads(json.dumps(original.state_dict()))  # as a checkpoint stores it
    assert state == {"next": 5, "consumed": [6, 9], "num_prompts": 7}
    resumed = PromptStream(prompts, seed=11)
    resumed.load_state_dict(state)
    again = resumed.take(5)
    assert [t for t, _ in again] == [5, 7, 8, 10, 11]
    assert [p for _, p in again] == [p for t, p in drawn if t in (5, 7, 8, 10, 11)]
    fresh = PromptStream(prompts, seed=11)
    fresh.take(12)
    assert [(t, p.index) for t, p in resumed.take(6)] == [(t, p.index) for t, p in fresh.take(6)]


def test_resume_refuses_a_different_dataset():
    state = PromptStream(make_prompts(7)).state_dict()
    with pytest.raises(ValueError, match="checkpoint saw 7 prompts, the dataset now has 8"):
        PromptStream(make_prompts(8)).load_state_dict(state)


def test_stream_needs_prompts():
    with pytest.raises(ValueError):
        PromptStream([])
