"""The rollout engines' number within its bounds (`cluster.rollout.min_actors` / `max_actors`), seen by the producer
on the local backend: an engine that dies above the lower bound is let go and its prompts go to the others; below
the upper bound, room reserved for one more engine starts it once Ray places it, and it takes chunks only once it
serves the newest weights. The same engine's death at the lower bound is replaced (tests/test_producer.py)."""

from types import SimpleNamespace
from typing import Any

import pytest

from distrl.cluster.backend import ActorLost, Done, LocalBackend, RayBackend
from distrl.cluster.group import LocalGroup
from distrl.cluster.producer import Producer
from distrl.config import RecoveryConfig, RewardConfig, RoleResources
from distrl.data.stream import PromptStream
from distrl.types.prompt import Prompt
from distrl.types.rollouts import Rollouts
from tests.one_turn import one_turn


class Echo:
    """An engine that answers "2" to every prompt, once (n = 1), stamped with version `served`; it dies in its
    generation when `dies` says so."""

    def __init__(self, served: int = 0, dies: bool = False):
        self.served, self.dies = served, dies

    def version(self) -> int:
        return self.served

    def generate(self, prompts: list[Prompt], groups: list[int]) -> Rollouts:
        if self.dies:
            raise ActorLost("its node was lost")
        k = len(prompts)
        return one_turn(prompt_ids=[p.prompt_ids for p in prompts], response_ids=[[3]] * k,
                        rollout_logprobs=[[-0.5]] * k, response_texts=["2"] * k, finish_reasons=["stop"] * k,
                        group=list(groups), policy_version=[self.served] * k)


class Pending(LocalBackend):
    """A local backend on which a handle whose value is "pending" is not done yet (room Ray has not placed)."""

    def wait(self, handles, timeout=None):
        done = [h for h in handles if not (isinstance(h, Done) and h.value == "pending")]
        return done, [h for h in handles if h not in done]


class FakePlacement:
    """A role's placement as the engines see it: `add` reserves room for one more engine (placed at once, or
    "pending"); `release` gives an engine's room back."""

    def __init__(self, size: int, placed: bool = True):
        self.resources = RoleResources(labels={"pool": "inference"})
        self.slots, self.placed, self.released = size, placed, []
        self.ready: Done | None = None

    def add(self) -> tuple[int, Any]:
        self.slots += 1
        self.ready = Done(None if self.placed else "pending")
        return self.slots - 1, self.ready

    def release(self, index: int) -> None:
        self.released.append(index)

    def withdraw(self) -> None:
        self.slots -= 1
        self.withdrawn = getattr(self, "withdrawn", 0) + 1


def producer(group: LocalGroup, load_weights, fewest: int, most: int, k: int = 1, pushes_skip: bool = True,
             recovery: RecoveryConfig | None = None) -> Producer:
    stream = PromptStream([Prompt(i, "1+1=", [1, 2], answer="2") for i in range(64)], seed=0, shuffle=False)
    return Producer(group, stream, RewardConfig(), prompts_per_step=4, max_staleness=k, chunk_prompts=1,
                    dynamic_sampling=None, load_weights=load_weights, recovery=recovery or RecoveryConfig(),
                    call_timeout_s=60.0, engines=(fewest, most), pushes_skip=pushes_skip)


def test_an_engine_that_dies_above_the_lower_bound_is_let_go_and_the_others_take_its_prompts():
    placement = FakePlacement(2, placed=False)  # no room for another engine: its reservation waits
    group = LocalGroup("rollout", Pending(), lambda i, incarnation: Echo(dies=i == 1), 2, placement)
    loaded: list[int] = []
    p = producer(group, lambda i: loaded.append(i) or Done(0), fewest=1, most=2)
    batch, stats = p.next_batch(step=1)
    assert sorted(batch.rollouts.group) == [0, 1, 2, 3]  # engine 1's prompt went to engine 0, ticket kept
    assert stats.redispatched_prompts == 1 and stats.rollout_retired == 1 and stats.rollout_restarts == 0
    assert group.active() == [0] and placement.released == [1] and loaded == []
    assert 1 not in p.idle and stats.metrics()["rollout/engines"] == 1.0
    assert p.engines.growing is placement.ready  # room for one more engine is reserved, waiting for a node


def test_an_engine_added_when_room_appears_serves_the_newest_weights_then_takes_chunks():
    """Room for a second engine is placed at once: the engine starts, loads the weights; its first load serves a
    version older than the newest push, so it loads again, and only then takes chunks."""
    placement = FakePlacement(1)
    made: list[int] = []

    def make(i: int, incarnation: int) -> Echo:
        made.append(i)
        return Echo(served=3)

    group = LocalGroup("rollout", LocalBackend(), make, 1, placement)
    loads = iter([Done(2), Done(3)])
    loaded: list[int] = []
    p = producer(group, lambda i: loaded.append(i) or next(loads), fewest=1, most=2)
    p.set_version(3)
    batch, stats = p.next_batch(step=4)
    assert made == [0, 1] and group.active() == [0, 1] and loaded == [1, 1]
    assert stats.rollout_added == 1 and stats.metrics()["rollout/engines"] == 2.0
    assert p.engines.growing is None and placement.slots == 2  # at max_actors: no more room is reserved
    assert sorted(batch.rollouts.group) == [0, 1, 2, 3]


def test_an_engine_is_not_added_before_ray_places_its_room():
    placement = FakePlacement(1, placed=False)
    group = LocalGroup("rollout", Pending(), lambda i, incarnation: Echo(), 1, placement)
    # The learners' current weights; the engine stamps version 0, which k = 4 keeps usable.
    p = producer(group, lambda i: Done(p.version), fewest=1, most=3, k=4)
    p.next_batch(step=1)
    p.set_version(1)
    p.next_batch(step=2)
    assert group.active() == [0] and placement.slots == 2  # one reservation waits; no second one is made
    placement.ready.value = None  # a node joins: Ray places the group
    p.set_version(2)
    p.next_batch(step=3)
    assert group.active() == [0, 1] and placement.slots == 3  # the next engine's room is reserved in turn


def test_a_group_maps_over_its_active_workers_only():
    group = LocalGroup("rollout", LocalBackend(), lambda i, incarnation: Echo(served=i), 3)
    group.retire(1)
    assert [h.value for h in group.map(Echo.version)] == [0, 2]
    assert len(group) == 3 and group.active() == [0, 2]


def test_at_the_lower_bound_a_replacement_takes_the_room_reserved_for_one_more_engine():
    """Engine 0 of one dies while room for a second waits: the reservation is withdrawn (it could take the node the
    replacement waits for), the replacement loads the weights, and once it serves the room is reserved again."""
    placement = FakePlacement(1, placed=False)
    group = LocalGroup("rollout", Pending(), lambda i, incarnation: Echo(), 1, placement)
    p = producer(group, lambda i: Done(0), fewest=1, most=2)
    assert p.engines.growing is not None and placement.slots == 2
    p.lost(0, 0, ActorLost("its node was lost"))
    assert placement.withdrawn == 1 and group.incarnations == [1]
    assert p.engines.growing is None and placement.slots == 1
    p.next_batch(step=1)  # the replacement serves, then room for one more is reserved again
    assert p.engines.growing is not None and placement.slots == 2 and p.engines.counts.restarts == 0


class Unreachable(LocalBackend):
    """A local backend on which an engine's death reads as Ray's "cannot be reached" (its node lost, not yet
    declared)."""

    def unreachable(self, error: BaseException) -> bool:
        return True


class Declared(LocalGroup):
    """A group whose cluster gives its word on a worker as `verdicts` say (True dead, False answering again, None
    no word yet), one answer per question."""

    def __init__(self, *args, verdicts: list[bool | None], **kwargs):
        super().__init__(*args, **kwargs)
        self.verdicts = verdicts

    def verdict(self, index: int) -> bool | None:
        return self.verdicts.pop(0)


@pytest.fixture
def ask_every_poll(monkeypatch):
    """Ray is asked about unreachable engines at every poll (not at most once a second), so that tests need not wait."""
    from distrl.cluster import engines

    monkeypatch.setattr(engines, "VERDICT_POLL_S", 0.0)


def test_an_unreachable_engine_is_replaced_only_once_ray_declares_it_dead(ask_every_poll):
    """At min_actors: no replacement is sent to the lost node's bundle while Ray has not declared the engine dead
    (it would die there too, a second death for one loss); pushes leave the engine out meanwhile."""
    loaded: list[int] = []
    group = Declared("rollout", Unreachable(), lambda i, incarnation: Echo(), 1, verdicts=[None, None, True])
    p = producer(group, lambda i: loaded.append(i) or Done(0), fewest=1, most=1)
    p.lost(0, 0, ActorLost("cannot be reached"))
    assert p.starting() == {0} and group.incarnations == [0]  # waiting for the verdict
    p.engines.poll()
    p.engines.poll()
    assert group.incarnations == [0] and loaded == []
    p.engines.poll()  # declared dead: replaced, within the restart budget
    assert group.incarnations == [1] and loaded == [0] and p.engines.counts.restarts == 1
    assert not p.engines.unsure and p.engines.lost(0, 0, ActorLost("the same death, reported again")) is False


def test_ray_is_asked_about_an_unreachable_engine_at_most_once_a_second():
    group = Declared("rollout", Unreachable(), lambda i, incarnation: Echo(), 1, verdicts=[None])
    p = producer(group, lambda i: Done(0), fewest=1, most=1)
    p.lost(0, 0, ActorLost("cannot be reached"))
    for _ in range(100):
        p.engines.poll()
    assert group.verdicts == []  # asked once: the hundred polls came within the second


def test_an_engine_that_stays_unreachable_is_replaced_after_the_wait(ask_every_poll):
    group = Declared("rollout", Unreachable(), lambda i, incarnation: Echo(), 1, verdicts=[])
    p = producer(group, lambda i: Done(0), fewest=1, most=1,
                 recovery=RecoveryConfig(verdict_timeout_s=1e-9))
    p.lost(0, 0, ActorLost("cannot be reached"))
    p.engines.poll()  # no verdict asked: the wait is over
    assert group.incarnations == [1] and not p.engines.unsure


class UnreachablePending(Pending):
    def unreachable(self, error: BaseException) -> bool:
        return True


def test_under_a_sync_that_cannot_leave_an_engine_out_an_unreachable_one_is_replaced_at_once():
    """NCCL: a broadcast needs every rank, so an engine left in the world while Ray decides would fail the next
    push; it is replaced (and the world formed again) at once."""
    group = Declared("rollout", Unreachable(), lambda i, incarnation: Echo(), 1, verdicts=[])
    p = producer(group, lambda i: Done(0), fewest=1, most=1, pushes_skip=False)
    p.lost(0, 0, ActorLost("cannot be reached"))
    assert not p.engines.unsure and group.incarnations == [1]


def test_a_chunk_an_unreachable_engine_returns_gives_it_no_new_chunk_and_its_idle_time_ends_when_let_go(
        ask_every_poll):
    """Engine 0 is found unreachable (by a push) while its chunk is in flight; the chunk still comes back (it had
    finished): the engine takes no new chunk while Ray decides. Let go at the verdict (an engine joined), it no
    longer counts as an idle rollout actor."""
    placement = FakePlacement(1, placed=False)
    group = Declared("rollout", UnreachablePending(), lambda i, incarnation: Echo(), 1, placement, verdicts=[True])
    p = producer(group, lambda i: Done(0), fewest=1, most=2)
    p._admit()
    (handle,) = p.in_flight
    p.lost(0, 0, ActorLost("cannot be reached"))
    p._on_generated(handle)
    assert p.idle == [] and p.engines.unsure
    placement.ready.value = None
    p._on_engines(p.engines.growing)  # engine 1 joins (and loads the weights)
    p._poll_engines()  # the verdict: dead; let go
    assert group.retired == {0} and 0 not in p.idle
    assert 0 not in p._idle_since and p._idle_fraction() <= 1.0


def test_an_unreachable_engine_is_let_go_if_an_engine_joined_before_ray_declared_it_dead(ask_every_poll):
    """At min_actors engine 0 cannot be reached; before Ray's verdict a node joins and the room reserved for a
    second engine starts one there; when the verdict comes, the bounds allow letting engine 0 go: no replacement
    waits for a node that the new engine has taken."""
    placement = FakePlacement(1, placed=False)
    group = Declared("rollout", UnreachablePending(), lambda i, incarnation: Echo(), 1, placement, verdicts=[True])
    p = producer(group, lambda i: Done(0), fewest=1, most=2)
    p.lost(0, 0, ActorLost("cannot be reached"))
    assert p.engines.unsure and group.active() == [0]
    placement.ready.value = None  # a node joins: Ray places the reservation
    p._on_engines(p.engines.growing)
    assert group.active() == [0, 1]
    p.engines.poll()  # the verdict: dead
    assert group.active() == [1] and placement.released == [0]
    assert (p.engines.counts.retired, p.engines.counts.restarts, p.engines.counts.added) == (1, 0, 1)


class RayErrors(LocalBackend):
    """Reads errors as the Ray backend does, without starting a cluster."""

    lost = RayBackend.lost
    unreachable = RayBackend.unreachable


class FakeActor:
    """A Ray actor handle as `RayGroup` reads it: its id."""

    def __init__(self, hex_id: str):
        self._actor_id = SimpleNamespace(hex=lambda: hex_id)


def test_a_call_to_an_engine_replaced_since_is_still_that_engines_loss():
    """A push sent to engine 0 before it was replaced fails with its old actor's death (its node lost): the group
    reads that as engine 0's, for the producer to see it was replaced already, and not as another actor's death
    that the push took a result from (learner 0's), which ends the run."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    from distrl.cluster.group import RayGroup

    ids = iter(["aa" * 16, "bb" * 16, "cc" * 16])
    group = RayGroup("rollout", RayErrors(), lambda i, incarnation: FakeActor(next(ids)), 1)
    group._end = lambda worker: None  # nothing to kill: the fakes are no actors
    group.restart(0)
    old, current, other = (ActorUnavailableError("node lost", bytes.fromhex(h)) for h in ("aa" * 16, "bb" * 16,
                                                                                        "dd" * 16))
    assert group.lost(0, old) and group.lost(0, current)
    assert not group.lost(0, other)  # another actor's death (a learner's), which the call took a result from
    assert group.lost(0, ActorDiedError())  # a death that names no actor is the callee's


def test_a_chunk_result_lost_with_its_node_is_its_engines_loss_awaiting_rays_verdict():
    """A chunk's result stored on a node that is then lost cannot be fetched (ObjectLostError): the engine that made
    it is gone with its node, which Ray may not have declared dead yet."""
    from ray.exceptions import ObjectLostError, RayTaskError

    backend = RayErrors()
    lost_result = ObjectLostError("ab" * 14, "", "")
    assert backend.lost(lost_result) and backend.unreachable(lost_result)
    raised = RayTaskError("generate", "Traceback ...", ValueError("a bad prompt"))
    assert not backend.lost(raised) and not backend.unreachable(raised)


def test_an_engine_that_could_not_fetch_a_lost_learners_weights_is_not_lost_itself():
    """An engine's weight load fetches learner 0's buckets itself; with that learner's node lost the fetch fails and
    Ray raises the engine's task error as an instance of ObjectLostError too: the engine is alive, the learner is
    not, and the engine must not be left out or replaced for it."""
    from ray.exceptions import ObjectLostError, RayTaskError

    backend = RayErrors()
    cause = ObjectLostError("ab" * 14, "", "")
    raised = RayTaskError("load_weights", "Traceback ...", cause).as_instanceof_cause()
    assert isinstance(raised, ObjectLostError)  # as Ray hands it back
    assert not backend.lost(raised) and not backend.unreachable(raised)


def test_an_unreachable_engine_that_answers_again_is_replaced_at_once(ask_every_poll):
    """It missed the pushes made while it was left out; its node is alive, so a replacement can start there now
    rather than after the whole wait for a verdict that will not come."""
    group = Declared("rollout", Unreachable(), lambda i, incarnation: Echo(), 1, verdicts=[None, False])
    p = producer(group, lambda i: Done(0), fewest=1, most=1)
    p.lost(0, 0, ActorLost("cannot be reached"))
    p.engines.poll()
    assert group.incarnations == [0] and p.engines.unsure
    p.engines.poll()  # it answers
    assert group.incarnations == [1] and not p.engines.unsure and p.engines.counts.restarts == 1


class UnreachableUnlessDead(LocalBackend):
    """Reads an engine's death as final and anything else as Ray's "cannot be reached"."""

    def unreachable(self, error: BaseException) -> bool:
        return not isinstance(error, ActorDied)


class ActorDied(ActorLost):
    """Stands for Ray's ActorDiedError: the actor is declared dead."""


def test_a_death_reported_for_an_engine_awaiting_rays_word_is_that_word(ask_every_poll):
    group = Declared("rollout", UnreachableUnlessDead(), lambda i, incarnation: Echo(), 1, verdicts=[])
    p = producer(group, lambda i: Done(0), fewest=1, most=1)
    assert p.engines.lost(0, 0, ActorLost("cannot be reached"))
    assert p.engines.lost(0, 0, ActorLost("cannot be reached, again")) is False  # the same loss, reported twice
    assert group.incarnations == [0] and p.engines.unsure
    assert p.engines.lost(0, 0, ActorDied("declared dead"))  # a chunk's call failing with the verdict
    assert group.incarnations == [1] and not p.engines.unsure and group.verdicts == []
