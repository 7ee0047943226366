"""How the producer cuts a step's prompts into generation requests by default, and how it counts deaths."""

import time

import pytest

from distrl.cluster.backend import ActorLost, Done, LocalBackend
from distrl.cluster.group import LocalGroup
from distrl.cluster.producer import Producer, default_chunk
from distrl.config import DynamicSamplingConfig, RecoveryConfig, RewardConfig
from distrl.data.stream import PromptStream
from distrl.types.prompt import Prompt
from distrl.types.rollouts import PARTIAL, Episode, Rollouts
from tests.one_turn import one_turn


@pytest.mark.parametrize("prompts,actors,k,chunk", [
    (8, 2, 0, 4),   # synchronous: one chunk per engine per step
    (8, 2, 1, 2),   # asynchronous: two, so engines switch weights between them
    (8, 3, 0, 3),   # rounded up: the last engine takes the rest
    (8, 3, 2, 2),
    (1, 4, 1, 1),   # never empty
])
def test_default_chunk(prompts, actors, k, chunk):
    assert default_chunk(prompts, actors, k) == chunk


def test_a_death_reported_twice_replaces_the_actor_once():
    """A chunk in flight and a weight push can both report one death; the second report names an incarnation
    already replaced and changes nothing."""
    backend = LocalBackend()
    group: LocalGroup = LocalGroup("rollout", backend, lambda i, incarnation: object(), 2)
    replaced: list[int] = []

    def load_weights(i: int) -> Done:
        replaced.append(i)
        return Done(3)

    stream = PromptStream([Prompt(0, "1+1=", [1, 2])], seed=0, shuffle=False)
    producer = Producer(group, stream, RewardConfig(), prompts_per_step=2,
                        max_staleness=0, chunk_prompts=None, dynamic_sampling=None, load_weights=load_weights,
                        recovery=RecoveryConfig(max_restarts=1), call_timeout_s=60.0)
    producer.lost(1, 0, ActorLost("killed"))
    producer.lost(1, 0, ActorLost("killed"))
    assert replaced == [1] and group.incarnations == [0, 1] and group.name(1) == "rollout-1 (replacement 1)"
    assert producer.idle == [0] and producer.engines.counts.restarts == 1
    with pytest.raises(RuntimeError, match=r"rollout actor rollout-1 \(replacement 1\) died; it died 2 times"):
        producer.lost(1, 1, ActorLost("killed again"))


class Echo:
    """A rollout worker that answers "2" to every prompt, once (n = 1)."""

    def generate(self, prompts: list[Prompt], groups: list[int]) -> Rollouts:
        k = len(prompts)
        return one_turn(prompt_ids=[p.prompt_ids for p in prompts], response_ids=[[3]] * k,
                        rollout_logprobs=[[-0.5]] * k, response_texts=["2"] * k, finish_reasons=["stop"] * k,
                        group=list(groups), policy_version=[0] * k)


def test_a_chunk_that_returns_after_its_engine_was_replaced_does_not_hand_the_engine_out_twice():
    """A push finds engine 0 dead while a chunk it finished is not yet collected: the chunk's samples are kept,
    and engine 0 is handed out again once, by its replacement."""
    group: LocalGroup = LocalGroup("rollout", LocalBackend(), lambda i, incarnation: Echo(), 1)
    stream = PromptStream([Prompt(i, "1+1=", [1, 2], answer="2") for i in range(4)], seed=0, shuffle=False)
    producer = Producer(group, stream, RewardConfig(), prompts_per_step=2, max_staleness=0, chunk_prompts=None,
                        dynamic_sampling=None, load_weights=lambda i: Done(0), recovery=RecoveryConfig(),
                        call_timeout_s=60.0)
    producer._admit()  # the chunk is done (local calls run at once) but not yet collected
    producer.lost_in_push({0: (0, ActorLost("killed in load_weights"))})
    batch, stats = producer.next_batch(step=1)
    assert sorted(batch.rollouts.group) == [0, 1] and stats.rollout_restarts == 1
    assert stats.redispatched_prompts == 0  # its samples came back before it died
    assert producer.idle.count(0) <= 1


class NeverReady(LocalBackend):
    """A local backend on which a call whose value is "never" does not finish."""

    def wait(self, handles, timeout=None):
        done = [h for h in handles if not (isinstance(h, Done) and h.value == "never")]
        return done, [h for h in handles if h not in done]


def test_a_replacement_that_never_serves_ends_the_run_naming_it():
    group: LocalGroup = LocalGroup("rollout", NeverReady(), lambda i, incarnation: Echo(), 1)
    stream = PromptStream([Prompt(i, "1+1=", [1, 2], answer="2") for i in range(4)], seed=0, shuffle=False)
    producer = Producer(group, stream, RewardConfig(), prompts_per_step=2, max_staleness=0, chunk_prompts=None,
                        dynamic_sampling=None, load_weights=lambda i: Done("never"),
                        recovery=RecoveryConfig(start_timeout_s=0.05), call_timeout_s=60.0)
    producer.lost(0, 0, ActorLost("killed"))
    with pytest.raises(TimeoutError, match=r"rollout actor rollout-0 \(replacement 1\) does not serve within "
                                           r"cluster\.recovery\.start_timeout_s = 0\.05 s of being replaced: its "
                                           r"placement bundle may have no node"):
        producer.next_batch(step=1)


class Hangs(Echo):
    """A rollout worker whose generation never returns."""

    def generate(self, prompts: list[Prompt], groups: list[int]) -> str:
        return "never"


def hanging_producer(worker: type) -> Producer:
    group: LocalGroup = LocalGroup("rollout", NeverReady(), lambda i, incarnation: worker(), 1)
    stream = PromptStream([Prompt(i, "1+1=", [1, 2], answer="2") for i in range(4)], seed=0, shuffle=False)
    return Producer(group, stream, RewardConfig(), prompts_per_step=2, max_staleness=0, chunk_prompts=None,
                    dynamic_sampling=None, load_weights=lambda i: Done(0), recovery=RecoveryConfig(),
                    call_timeout_s=0.05)


def test_a_generation_that_never_returns_ends_the_run_naming_the_engine():
    with pytest.raises(TimeoutError, match=r"^rollout-0's generation of 2 prompts has not returned within "
                                           r"cluster\.call_timeout_s = 0\.05 s$"):
        hanging_producer(Hangs).next_batch(step=1)


def test_a_call_waited_for_that_never_returns_is_named():
    """What the driver waits for while the engines generate (an update, log-probs) has the same bound."""
    producer = hanging_producer(Echo)
    assert producer.wait_for([Done(1), Done(2)], ["learner-0's update", "learner-1's update"]) == [1, 2]
    with pytest.raises(TimeoutError, match=r"^learner-1's update has not returned within cluster\.call_timeout_s"):
        producer.wait_for([Done(1), Done("never")], ["learner-0's update", "learner-1's update"])


def test_work_done_in_time_but_collected_late_is_not_late():
    """The driver may be busy elsewhere (a weight push, a checkpoint) while a call finishes: past its deadline but
    done, it is collected, not reported."""
    producer = hanging_producer(Echo)
    done, other = Done(1), Done(2)
    producer._due(done, time.perf_counter() - 1.0, "learner-0's update")
    assert producer._step([done]) == [done]
    # Past its deadline, ready, but not among what one wait returned (a Ray wait returns one handle at a time).
    producer._due(done, time.perf_counter() - 1.0, "learner-0's update")
    producer.deadlines.raise_if_late([done, other], [other], time.perf_counter())


@pytest.mark.parametrize("prompts,actors,k,slots,chunk", [
    (8, 1, 0, 4, 2),  # an engine serving 4 chunks at once gets 4 a step
    (8, 2, 1, 4, 1),
    (8, 1, 1, 1, 4),  # one slot: the asynchronous loop's 2 chunks
])
def test_default_chunk_fills_an_engines_slots(prompts, actors, k, slots, chunk):
    assert default_chunk(prompts, actors, k, slots) == chunk


class Held(Echo):
    """A rollout worker whose chunks stay in flight until the test lets them go (their handles are not done)."""

    def generate(self, prompts: list[Prompt], groups: list[int]) -> str:
        return "never"


def test_an_engine_with_slots_takes_that_many_chunks_and_a_death_frees_them_all():
    group: LocalGroup = LocalGroup("rollout", NeverReady(), lambda i, incarnation: Held(), 2)
    stream = PromptStream([Prompt(i, "1+1=", [1, 2], answer="2") for i in range(16)], seed=0, shuffle=False)
    replaced: list[int] = []

    def load_weights(i: int) -> Done:
        replaced.append(i)
        return Done(0)

    producer = Producer(group, stream, RewardConfig(), prompts_per_step=8, max_staleness=0, chunk_prompts=None,
                        dynamic_sampling=None, load_weights=load_weights, recovery=RecoveryConfig(),
                        call_timeout_s=60.0, chunks_per_engine=3)
    assert producer.chunk == 2 and sorted(producer.idle) == [0, 0, 0, 1, 1, 1]
    producer._admit()  # 8 prompts of room: 4 chunks of 2, into the free slots (the last listed first)
    assert sorted(c.actor for c in producer.in_flight.values()) == [0, 1, 1, 1] and producer.idle == [0, 0]
    assert producer._idle_since == {}  # both engines have a chunk: neither counts as idle
    producer.lost(1, 0, ActorLost("killed"))
    assert 1 not in producer.idle and replaced == [1]  # none of its slots is handed out until it serves
    producer._on_engines(next(iter(producer.engines.loading)))
    assert producer.idle.count(1) == 3


class Summarising:
    """A rollout worker whose prompts get two episodes each (n = 2): the first trained as two sequences (an agent
    that starts a fresh conversation; it answers "2" in the second), the second as one, answering `second`.
    `reward` set: the environment's, on every row of an episode."""

    def __init__(self, second: str, reward: dict[str, float] | None = None):
        self.second, self.reward = second, reward

    def generate(self, prompts: list[Prompt], groups: list[int]) -> Rollouts:
        out = Rollouts.empty()
        for p, g in zip(prompts, groups, strict=True):
            for segment, text, answer in ((0, "9", "2"), (1, "2", "2"), (0, self.second, self.second)):
                reward = None if self.reward is None else self.reward[answer]
                episode = Episode(turns=0 if segment else 1, reward=reward, segment=segment)
                out.add(p.prompt_ids, [3], [-0.5], [1], [0], text, "stop", g, episode, 0)
        return out.validate()


def segmented_producer(worker: Summarising, filtering: bool = False, prompts: int = 2) -> Producer:
    group: LocalGroup = LocalGroup("rollout", LocalBackend(), lambda i, incarnation: worker, 1)
    stream = PromptStream([Prompt(i, "1+1=", [1, 2], answer="2") for i in range(8)], seed=0, shuffle=False)
    return Producer(group, stream, RewardConfig(), prompts_per_step=prompts, max_staleness=0, chunk_prompts=None,
                    dynamic_sampling=DynamicSamplingConfig(max_rounds=2) if filtering else None,
                    load_weights=lambda i: Done(0), recovery=RecoveryConfig(), call_timeout_s=60.0)


def test_a_reward_function_scores_each_episode_once_on_its_last_sequence_and_every_row_holds_it():
    batch, stats = segmented_producer(Summarising(second="7")).next_batch(step=1)
    # Per prompt: episode 0 = rows "9", "2" (scored on "2": 1.0 on both rows), episode 1 = row "7" (0.0).
    assert batch.rollouts.group == [0, 0, 0, 1, 1, 1]
    assert batch.rewards == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert stats.scored == 4  # episodes, not rows


def test_environment_rewards_are_taken_as_they_are_on_every_row():
    batch, stats = segmented_producer(Summarising(second="7", reward={"2": 0.5, "7": 0.25})).next_batch(step=1)
    assert batch.rewards == [0.5, 0.5, 0.25] * 2 and stats.scored == 4


def test_dynamic_sampling_compares_episodes_not_rows():
    """Both episodes of every prompt answer "2": a flat group, whatever its three rows; filtered once, then the cap
    (max_rounds 2: one batch's worth, 1 prompt) lets the next one through."""
    batch, stats = segmented_producer(Summarising(second="2"), filtering=True, prompts=1).next_batch(step=1)
    assert stats.filtered_groups == 1 and stats.cap_reached == 1
    assert batch.rewards == [1.0, 1.0, 1.0] and len(set(batch.rollouts.group)) == 1
    batch, stats = segmented_producer(Summarising(second="7"), filtering=True, prompts=1).next_batch(step=1)
    assert stats.filtered_groups == 0 and stats.kept_groups == 1


class Tail:
    """A rollout worker for partial rollouts whose samples of prompt 0 are 13 tokens long and all others 1: each
    slice continues a sample from its prefix, stamped with `version` (which the test sets as a push would)."""

    version = 0

    def continue_samples(self, prefixes: Rollouts, samples: list[int], slice_tokens: int) -> Rollouts:
        out = Rollouts.empty()
        for i, ticket in enumerate(prefixes.group):
            done = prefixes.response_ids[i]
            total = 13 if ticket == 0 else 1
            new = list(range(len(done), min(total, len(done) + slice_tokens)))
            ids = [*done, *new]
            out.add(prefixes.prompt_ids[i], ids, [-0.5] * len(ids), [1] * len(ids),
                    [*prefixes.token_versions[i], *[Tail.version] * len(new)], "2" if len(ids) == total else "",
                    "stop" if len(ids) == total else PARTIAL, ticket, Episode(), Tail.version)
        return out


def tail_producer(worker: type[Tail]) -> Producer:
    """A producer of partial rollouts (slices of 2 tokens, 2 samples a prompt, k = 1) over one local `worker`."""
    group: LocalGroup = LocalGroup("rollout", LocalBackend(), lambda i, incarnation: worker(), 1)
    stream = PromptStream([Prompt(i, "1+1=", [1, 2], answer="2") for i in range(16)], seed=0, shuffle=False)
    return Producer(group, stream, RewardConfig(), prompts_per_step=2, max_staleness=1, chunk_prompts=2,
                    dynamic_sampling=None, load_weights=lambda i: Done(0), recovery=RecoveryConfig(),
                    call_timeout_s=60.0, slice_tokens=2, samples_per_prompt=2)


def test_partial_rollouts_hand_out_finished_groups_and_carry_the_tail_until_it_is_due():
    Tail.version = 0
    producer = tail_producer(Tail)
    first, stats = producer.next_batch(step=1)
    # Prompt 0's samples (13 tokens, 2 a call) are still going: the finished groups 1 and 2 make the batch.
    assert sorted(set(first.rollouts.group)) == [1, 2] and stats.carried_tokens is not None
    assert stats.carried_tokens > 0 and 0 in producer.carry.groups
    Tail.version = 1  # the update of step 1 is pushed
    producer.set_version(1)
    second, _ = producer.next_batch(step=2)
    # Step 3 could no longer train prompt 0's oldest tokens (version 0, k = 1): step 2 waited for it.
    assert 0 in second.rollouts.group
    rows = [i for i, t in enumerate(second.rollouts.group) if t == 0]
    versions = [second.rollouts.token_versions[i] for i in rows]
    assert [len(v) for v in versions] == [13, 13] and all(v[0] == 0 for v in versions)
    assert all(second.rollouts.policy_version[i] == 0 for i in rows)  # its staleness: 2 - 1 - 0 = 1 <= k
    assert any(1 in v for v in versions)  # it went on under the weights pushed meanwhile


class TailDying(Tail):
    """`Tail` whose first instance dies (as a killed actor does) in its second call."""

    made = 0

    def __init__(self):
        TailDying.made += 1
        self.calls, self.doomed = 0, TailDying.made == 1

    def continue_samples(self, prefixes: Rollouts, samples: list[int], slice_tokens: int) -> Rollouts:
        self.calls += 1
        if self.doomed and self.calls >= 2:
            raise ActorLost("killed")
        return super().continue_samples(prefixes, samples, slice_tokens)


def test_partial_rollouts_keep_the_prefixes_a_lost_chunk_held_and_count_them():
    Tail.version, TailDying.made = 0, 0
    producer = tail_producer(TailDying)
    batch, stats = producer.next_batch(step=1)
    # Call 1: prompts 0 and 1 (2 samples each); prompt 1's finish, prompt 0's have 2 tokens. Call 2 (prompt 0's two
    # samples, prompt 2's two) is lost: prompt 0's 2 + 2 tokens are kept and sent again, prompt 2's had none.
    assert stats.rollout_restarts == 1 and stats.redispatched_prompts == 2 and stats.redispatched_tokens == 4
    assert sorted(set(batch.rollouts.group)) == [1, 2]
    assert [len(producer.carry.groups[0].prefixes[j].response_ids[0]) for j in (0, 1)] == [6, 6]
    assert stats.metrics()["partial/redispatched_tokens"] == 4.0
