"""Partial rollouts' bookkeeping (`distrl.cluster.carry`) and the engine side's slices
(`distrl.workers.rollout.slices`), with a hand-written sampler: every admitted sample is in exactly one place until
its group is handed on whole (never trained twice, never lost, an engine's loss included), the staleness bound
holds for a sample's oldest token, and a resumed stream draws the unfinished groups again."""

import asyncio

import pytest

from distrl.agents.trajectory import TURN_STRIDE, Budget, Sampled, turn_seed
from distrl.cluster.carry import Carry
from distrl.data.stream import PromptStream
from distrl.types.prompt import Prompt
from distrl.types.rollouts import PARTIAL, Rollouts
from distrl.workers.rollout.slices import continue_samples, slice_length


class ScriptedSampler:
    """A sampler whose sample (ticket, j) is `lengths[(ticket, j)]` tokens long: token k of it is 100 + k, its
    log-prob -k/10; the version served is `version` (set by the test between calls), stamped on each token."""

    def __init__(self, lengths: dict[tuple[int, int], int], tickets_by_prompt: dict[int, int]):
        self.lengths, self.tickets, self.version = lengths, tickets_by_prompt, 0
        self.seeds: list[int] = []

    async def sample(self, prompt_ids: list[int], max_tokens: int, seed: int) -> Sampled:
        self.seeds.append(seed)
        ticket, j = self.tickets[prompt_ids[0]], seed % TURN_STRIDE  # the test's base seeds are 0: j + slice strides
        done = len(prompt_ids) - 1  # a one-token prompt, then the prefix
        total = self.lengths[(ticket, j)]
        take = min(max_tokens, total - done)
        ids = [100 + k for k in range(done, done + take)]
        return Sampled(list(prompt_ids), ids, [-k / 10 for k in range(done, done + take)], [self.version] * take,
                       "", "stop" if done + take == total else "length")


def prompts(n: int) -> list[tuple[int, Prompt]]:
    return [(t, Prompt(index=t, text=f"p{t}", prompt_ids=[t])) for t in range(n)]


def one_slice(sampler: ScriptedSampler, carry: Carry, limit: int, slice_tokens: int = 2):
    pieces = carry.take(limit)
    assert pieces is not None
    budget = Budget(1, 8, 64, 8)
    rows = asyncio.run(continue_samples(sampler, budget, pieces.prefixes, pieces.samples,
                                        [0] * len(pieces.samples), slice_tokens, lambda ids: str(len(ids))))
    return pieces, rows


def test_slice_length_is_the_slice_within_the_turn_and_the_context():
    # A turn of 8 new tokens in a context of 12: a prompt of 3 with 5 done leaves 3 (turn) and 4 (context).
    assert slice_length(Budget(1, 8, 12, 8), prompt=3, done=5, slice_tokens=2) == (2, 3)
    assert slice_length(Budget(1, 8, 12, 8), prompt=3, done=6, slice_tokens=4) == (2, 2)  # 8 - 6
    assert slice_length(Budget(1, 8, 10, 8), prompt=3, done=5, slice_tokens=4) == (2, 2)  # 10 - 3 - 5


def test_a_sample_continued_across_a_weight_push_keeps_its_tokens_and_their_versions():
    carry = Carry(n=2)
    carry.admit(prompts(1), version=0)
    sampler = ScriptedSampler({(0, 0): 1, (0, 1): 5}, {0: 0})
    sent, rows = one_slice(sampler, carry, 2)
    assert rows.finish_reasons == ["stop", PARTIAL]  # the second used its slice of 2 with 3 still to go
    assert carry.returned(sent, rows) == []
    sampler.version = 1  # a push between the two calls
    sent, rows = one_slice(sampler, carry, 2)
    assert rows.response_ids == [[100, 101, 102, 103]] and rows.token_versions == [[0, 0, 1, 1]]
    assert rows.rollout_logprobs == [[0.0, -0.1, -0.2, -0.3]]  # each token keeps its own behaviour log-prob
    assert rows.policy_version == [0]  # the oldest token: what its staleness is counted from
    assert carry.returned(sent, rows) == []
    sent, rows = one_slice(sampler, carry, 2)
    ((ticket, _, group),) = carry.returned(sent, rows)
    assert ticket == 0 and group.response_ids == [[100], [100, 101, 102, 103, 104]]
    assert group.token_versions == [[0], [0, 0, 1, 1, 1]] and group.finish_reasons == ["stop", "stop"]
    assert len(carry) == 0 and carry.held_tokens() == 0
    # Slice s of sample j is seeded turn_seed(base, j, s): the first slice draws what a one-turn episode does.
    assert sampler.seeds == [turn_seed(0, 0, 0), turn_seed(0, 1, 0), turn_seed(0, 1, 1), turn_seed(0, 1, 2)]


def test_every_sample_is_handed_on_once_and_none_is_lost_when_an_engine_dies():
    n, groups = 4, 6
    lengths = {(t, j): 1 + (t * 7 + j * 3) % 7 for t in range(groups) for j in range(n)}  # 1..7 tokens
    carry, sampler = Carry(n), ScriptedSampler(lengths, {t: t for t in range(groups)})
    carry.admit(prompts(groups), version=0)
    handed: list[int] = []
    calls = 0
    while len(carry):
        sent, rows = one_slice(sampler, carry, limit=5)
        calls += 1
        if calls % 3 == 0:  # every third chunk is lost with its engine: its pieces wait again, prefixes kept
            carry.lost(sent)
            continue
        for ticket, _, group in carry.returned(sent, rows):
            handed.append(ticket)
            assert [len(r) for r in group.response_ids] == [lengths[(ticket, j)] for j in range(n)]
            assert group.response_ids == [[100 + k for k in range(len(r))] for r in group.response_ids]
    assert sorted(handed) == list(range(groups))  # each group once, whole
    assert carry.take(5) is None and not carry.in_flight


def test_a_piece_that_comes_back_twice_is_refused():
    carry = Carry(n=1)
    carry.admit(prompts(1), version=0)
    sent, rows = one_slice(ScriptedSampler({(0, 0): 5}, {0: 0}), carry, 1)
    carry.returned(sent, rows)
    with pytest.raises(KeyError):  # it is waiting again, not in flight
        carry.returned(sent, rows)
    with pytest.raises(ValueError, match="admitted twice"):
        carry.admit(prompts(1), version=0)


def test_a_group_is_due_when_its_oldest_token_would_be_too_old_for_the_next_step():
    carry = Carry(n=1)
    carry.admit(prompts(2), version=0)  # ticket 0 gets a token at version 0; ticket 1 none yet
    sampler = ScriptedSampler({(0, 0): 9, (1, 0): 9}, {0: 0, 1: 1})
    sent = carry.take(1)
    assert sent is not None
    rows = asyncio.run(continue_samples(sampler, Budget(1, 8, 64, 8), sent.prefixes, sent.samples, [0], 2, str))
    carry.returned(sent, rows)
    carry.groups[1].admitted = 1  # as if drawn after the push of version 1
    assert carry.oldest(0) == 0 and carry.oldest(1) == 1
    # k = 1: step s trains versions >= s - 2; step s + 1 needs >= s - 1. At step 2, version 0 is due (step 3 could
    # not train it: 3 - 1 - 0 = 2 > 1), version 1 is not.
    assert carry.due(step=1, k=1) == [] and carry.due(step=2, k=1) == [0] and carry.due(step=3, k=1) == [0, 1]
    assert carry.held_tokens() == 2


def test_a_resumed_stream_draws_the_unfinished_groups_again_and_no_trained_one():
    stream = PromptStream([p for _, p in prompts(10)], shuffle=False)
    drawn = stream.take(6)
    carry = Carry(n=1)
    carry.admit(drawn, version=0)
    sampler = ScriptedSampler({(t, 0): 1 if t % 2 else 9 for t in range(6)}, {t: t for t in range(6)})
    sent, rows = one_slice(sampler, carry, limit=6)
    trained = [t for t, _, _ in carry.returned(sent, rows)]
    assert trained == [1, 3, 5]
    stream.consume(trained)  # what a checkpoint records; the open groups 0, 2, 4 are not consumed
    resumed = PromptStream([p for _, p in prompts(10)], shuffle=False)
    resumed.load_state_dict(stream.state_dict())
    assert [t for t, _ in resumed.take(4)] == [0, 2, 4, 6]


def test_rows_that_come_back_for_other_pieces_are_refused():
    carry = Carry(n=1)
    carry.admit(prompts(2), version=0)
    sent = carry.take(2)
    assert sent is not None
    with pytest.raises(ValueError, match="1 rows came back for 2 pieces"):
        carry.returned(sent, sent.prefixes.select([0]))
    swapped = Rollouts.concat([sent.prefixes.select([1]), sent.prefixes.select([0])])
    with pytest.raises(ValueError, match="row 0 came back for ticket 1"):
        carry.returned(sent, swapped)
