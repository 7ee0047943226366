"""Weight pushes stream into the engines and have a time limit.

- An engine takes in one bucket at a time, as its reload reaches it, over the object store and over NCCL (a fake
  communicator on CPU): the previous bucket is gone before the next one is fetched or received. Each bucket reaches
  the engine as every learner's pieces of it, which it assembles.
- A load that fails midway leaves the engine refusing work; one that never finishes, or an NCCL broadcast that a dead
  or hung peer holds up, ends the run naming who did not finish, instead of a wait without end.
"""

import weakref
from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from distrl.cluster.backend import ActorLost, Done, LocalBackend
from distrl.cluster.group import LocalGroup
from distrl.cluster.weight_sync import NcclSync, ObjectStoreSync, StreamedBuckets
from distrl.workers.rollout.engine_loop import EngineLoop
from distrl.workers.rollout.engine_weights import EngineWeights
from distrl.workers.rollout.worker import RolloutWorker, Served, UnusableEngine
from distrl.workers.rollout.worker_extension import EngineWorker
from distrl.workers.weights import nccl
from distrl.workers.weights.export import Bucket
from distrl.workers.weights.pieces import BucketParts, Pieces, assemble


class FakeLearner:
    def weight_specs(self, bucket_bytes: int, dtype: str) -> list:
        return [[("w", (2,))]]

    def weight_pieces(self, spec: list, dtype: str) -> Pieces:
        return Pieces.whole({"w": torch.zeros(2)})


class FakeEngine:
    def __init__(self, hangs: bool):
        self.hangs = hangs

    def load_weights(self, version: int, buckets: Any) -> Any:
        return "hangs" if self.hangs else version


class Stalling(LocalBackend):
    """A local backend on which a call whose value is "hangs" never finishes: waiting for it runs out of time."""

    def get(self, handles: Any, timeout: float | None = None) -> Any:
        if isinstance(handles, Done) and handles.value == "hangs":
            raise TimeoutError
        return super().get(handles, timeout)

    def wait(self, handles, timeout=None):
        done = [h for h in handles if not (isinstance(h, Done) and h.value == "hangs")]
        return done, [h for h in handles if h not in done]


def test_a_push_an_engine_does_not_finish_in_time_names_the_engine():
    backend = Stalling()
    learners = LocalGroup("learner", backend, lambda i, incarnation: FakeLearner(), 1)
    engines = LocalGroup("rollout", backend, lambda i, incarnation: FakeEngine(hangs=i == 1), 2)
    sync = ObjectStoreSync(learners, engines, "float32", 2**20, timeout_s=5, verify=False)
    with pytest.raises(RuntimeError, match=r"weight sync: rollout-1 has not loaded \(and verified\) the weights of "
                                           r"version 3 within cluster\.sync_timeout_s = 5 s"):
        sync.push(3)


# ------------------------------------------------------------------------------------------------ streaming loads
Alive = list[Callable[[], bool]]
"""One check per tensor (or received buffer) handed out: whether it is still alive anywhere."""


def tracked(tensor: torch.Tensor, alive: Alive) -> torch.Tensor:
    ref = weakref.ref(tensor)
    alive.append(lambda: ref() is not None)
    return tensor


def count(alive: Alive) -> int:
    return sum(is_alive() for is_alive in alive)


class FakeLLM:
    """Stands for `vllm.LLM` with one worker (`worker_extension.EngineWorker`'s calls) in a RolloutWorker: its reload
    copies each tensor of a bucket into its own weights and lets go of it."""

    def __init__(self, fail_after: int | None = None):
        self.weights: dict[str, torch.Tensor] = {}
        self.fail_after = fail_after
        self.calls: list[str] = []

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self.calls.append(method)
        if method == "distrl_load":
            (bucket,) = args
            for name, tensor in bucket.items():  # (enumerate would keep the last pair alive)
                if len(self.weights) == self.fail_after:
                    raise RuntimeError("the reload failed")
                self.weights[name] = tensor.clone()
                del tensor  # as vLLM's loader does once a layer is processed
            return [None]
        assert method in ("distrl_begin_reload", "distrl_finish_reload"), method
        return [None]

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        pass


def worker(llm: FakeLLM) -> RolloutWorker:
    """A RolloutWorker around a fake engine (the real constructor starts vLLM) on an engine thread of its own."""
    engine = RolloutWorker.__new__(RolloutWorker)
    engine.engine = EngineLoop(lambda: llm)
    engine.llm, engine.served, engine._torn, engine.on_gpu, engine.lora = llm, Served(), None, False, None
    engine.weights = EngineWeights(llm, 1, None)
    engine.stepper = SimpleNamespace(in_flight=0)
    return engine


def bucket(i: int, per_bucket: int) -> dict[str, torch.Tensor]:
    """Bucket i: `per_bucket` tensors of shape [3]; tensor j is full of 10 * i + j."""
    return {f"b{i}.t{j}": torch.full((3,), 10.0 * i + j) for j in range(per_bucket)}


def made_one_by_one(alive: Alive, buckets: int, per_bucket: int, peaks: list[int]) -> Iterator[BucketParts]:
    """The buckets, each made only when asked for (as a fetch from the object store is), held whole by one learner,
    its tensors tracked; once each is made, how many tracked tensors are alive goes into `peaks`."""
    for i in range(buckets):
        made = {name: tracked(t, alive) for name, t in bucket(i, per_bucket).items()}
        peaks.append(count(alive))
        yield BucketParts([(name, (3,)) for name in made], [Pieces.whole(made)])
        del made


SENT = {"b0.t0": 0, "b0.t1": 1, "b1.t0": 10, "b1.t1": 11, "b2.t0": 20, "b2.t1": 21}


def test_an_engine_holds_one_bucket_at_a_time_while_loading():
    alive: Alive = []
    peaks: list[int] = []
    llm = FakeLLM()
    assert worker(llm).load_weights(4, made_one_by_one(alive, 3, 2, peaks)) == 4
    assert {name: t[0].item() for name, t in llm.weights.items()} == SENT
    # Only the new bucket's 2 tensors are alive once it is made: the previous one was let go before the next was
    # asked for (holding on to the last bucket gives [2, 4, 4]; a whole-model load, 6 before loading starts).
    assert peaks == [2, 2, 2]
    assert count(alive) == 0


def test_the_object_store_push_hands_each_engine_the_buckets_to_fetch_one_by_one():
    """Locally the handles are resolved already; over Ray, StreamedBuckets fetches each as iteration reaches it."""
    backend = LocalBackend()

    class Learner2(FakeLearner):
        def weight_specs(self, bucket_bytes: int, dtype: str) -> list:
            return [[("b0.t0", (3,)), ("b0.t1", (3,))], [("b1.t0", (3,)), ("b1.t1", (3,))]]

        def weight_pieces(self, spec: list, dtype: str) -> Pieces:
            return Pieces.whole(bucket(int(spec[0][0][1]), 2))

    llms = [FakeLLM(), FakeLLM()]
    learners = LocalGroup("learner", backend, lambda i, incarnation: Learner2(), 1)
    engines = LocalGroup("rollout", backend, lambda i, incarnation: worker(llms[i]), 2)
    ObjectStoreSync(learners, engines, "float32", 24, timeout_s=5, verify=False).push(2)
    for llm in llms:  # every engine got every tensor (the buckets are shared, not emptied by the first engine)
        assert {name: t[0].item() for name, t in llm.weights.items()} == {
            name: v for name, v in SENT.items() if name < "b2"}

    failed = StreamedBuckets([[Done(Pieces.whole({"a": torch.zeros(1)}))], [Done(error=ActorLost("learner 0 died"))]],
                             [[("a", (1,))], [("b", (1,))]])
    with pytest.raises(ActorLost, match="learner 0 died"):
        list(failed)


def test_an_engine_assembles_each_tensor_from_every_learners_rows():
    """Two sharded learners each send their own block of rows (learner 1 none of a one-row tensor); the engine loads
    the full tensors. Rows that overlap or leave a gap are refused, naming the tensor."""
    llm = FakeLLM()
    full = {"w": torch.arange(15.0).reshape(5, 3), "b": torch.tensor([7.0])}
    spec = [("w", (5, 3)), ("b", (1,))]
    parts = [Pieces(Bucket(w=full["w"][:3], b=full["b"]), {"w": 0, "b": 0}), Pieces(Bucket(w=full["w"][3:]), {"w": 3})]
    assert worker(llm).load_weights(1, [BucketParts(spec, parts)]) == 1
    assert torch.equal(llm.weights["w"], full["w"]) and torch.equal(llm.weights["b"], full["b"])
    overlapping = [Pieces(Bucket(w=full["w"][:3]), {"w": 0}), Pieces(Bucket(w=full["w"][2:]), {"w": 2})]
    with pytest.raises(ValueError, match=r"w: the learners' pieces do not tile its 5 rows"):
        assemble(BucketParts(spec[:1], overlapping))
    with pytest.raises(ValueError, match=r"w: the learners sent 3 of its 5 rows"):
        assemble(BucketParts(spec[:1], overlapping[:1]))


def test_a_load_that_fails_midway_leaves_an_engine_that_refuses_work():
    engine = worker(FakeLLM(fail_after=3))
    with pytest.raises(RuntimeError, match="the reload failed"):
        engine.load_weights(5, made_one_by_one([], 3, 2, []))
    assert engine.version() == 0  # version 5 was never served
    why = r"this rollout engine cannot serve: loading the weights of version 5 failed midway: .*; it must be replaced"
    calls: list[Callable[[], Any]] = [lambda: engine.generate([], []), lambda: engine.score([[1, 2]], 1),
                                      lambda: engine.check_weights(5, "rollout-0", {}),
                                      lambda: engine.load_weights(6, [])]
    for call in calls:
        with pytest.raises(UnusableEngine, match=why):
            call()


class Sender:
    """Rank 0's side of a fake NCCL communicator on CPU: keeps what each broadcast sends."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any) -> None:
        assert src == 0 and stream is None  # no CUDA stream off CUDA
        self.sent.append(tensor.clone())


class Receiver:
    """A receiving rank's side: each broadcast fills its buffer with the next flat tensor sent. The buffers (their
    storage: the received tensors are views of it) are tracked; at each broadcast, how many are alive goes into
    `peaks`."""

    def __init__(self, sent: Iterable[torch.Tensor]):
        self.sent = iter(sent)
        self.alive: Alive = []
        self.peaks: list[int] = []

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any) -> None:
        assert src == 0 and stream is None
        storage = StorageWeakRef(tensor.untyped_storage())
        self.alive.append(lambda: not storage.expired())
        self.peaks.append(count(self.alive))
        tensor.copy_(next(self.sent))


class ReceivingWorker(EngineWorker):
    """An engine's worker process (its distrl methods) over a fake model: a reload copies each bucket's tensors."""

    def __init__(self, receiver: Receiver):
        self._distrl_nccl, self._distrl_device, self.weights = receiver, torch.device("cpu"), {}

    def distrl_begin_reload(self) -> None:
        pass

    def distrl_load(self, bucket: Any) -> None:
        self.weights.update((name, t.clone()) for name, t in bucket.items())

    def distrl_finish_reload(self) -> None:
        pass


def test_an_nccl_push_receives_each_bucket_when_the_reload_reaches_it():
    specs = [[(f"b{i}.t{j}", (3,)) for j in range(2)] for i in range(3)]
    sender = Sender()
    for i in range(3):
        nccl.send_bucket(sender, bucket(i, 2), torch.device("cpu"))
    assert [t.tolist() for t in sender.sent][1] == [10.0] * 3 + [11.0] * 3  # a bucket travels flat
    receiver = Receiver(sender.sent)
    engine_worker = ReceivingWorker(receiver)
    engine_worker.distrl_nccl_receive(specs, "float32")
    assert {name: t.tolist() for name, t in engine_worker.weights.items()} == {
        name: [float(v)] * 3 for name, v in SENT.items()}
    # One received buffer at a time: bucket 0's was freed before bucket 1's was allocated (receiving all buckets
    # before loading gives [1, 2, 3]; holding on to the last one, [1, 2, 2]).
    assert receiver.peaks == [1, 1, 1]
    assert count(receiver.alive) == 0


# ------------------------------------------------------------------------------- forming the NCCL world (N4)
class Journal:
    """What the fakes of an NCCL world were asked, in order: (who, what, arguments)."""

    def __init__(self, hangs: bool = False, dies: frozenset[str] = frozenset()):
        self.entries: list[tuple[str, str, tuple]] = []
        self.hangs = hangs  # learner 0's broadcast never ends (a peer holds it up)
        self.dies = dies  # engines whose receive fails as a dead actor's would

    def note(self, who: str, what: str, *args: Any) -> None:
        self.entries.append((who, what, args))

    def of(self, what: str) -> list[tuple[str, tuple]]:
        return [(who, args) for who, w, args in self.entries if w == what]


class WorldLearner(FakeLearner):
    """Learner 0 as the NCCL world sees it: a free port (a new one each time), a connect, a broadcast."""

    def __init__(self, journal: Journal):
        self.journal, self.ports, self.updates = journal, iter(range(29500, 29600)), 0

    def free_port(self, host: str) -> int:
        return next(self.ports)

    def nccl_connect(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        self.journal.note("learner-0", "connect", host, port, 0, world_size, timeout_s)

    def nccl_send(self, specs: list, dtype: str) -> str | None:
        self.journal.note("learner-0", "send")
        return "hangs" if self.journal.hangs else None

    def weights_version(self) -> int:
        return self.updates


class WorldEngine:
    """An engine as the NCCL world sees it: its version once constructed, a connect, a receive."""

    def __init__(self, journal: Journal, name: str, starting: str | int = 0):
        self.journal, self.name, self.served = journal, name, starting

    def version(self) -> str | int:
        self.journal.note(self.name, "version")
        return self.served

    def nccl_connect(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        self.journal.note(self.name, "connect", host, port, rank, world_size, timeout_s)

    def nccl_receive(self, version: int, specs: list, dtype: str) -> int:
        self.journal.note(self.name, "receive", version)
        if self.name in self.journal.dies:
            raise ActorLost(f"{self.name} died")
        self.served = version
        return version


def nccl_world(journal: Journal, engines: int = 2, backend: LocalBackend | None = None, starting=lambda i: 0,
               workers: int = 1) -> tuple[NcclSync, LocalGroup]:
    backend = backend or LocalBackend()
    learners = LocalGroup("learner", backend, lambda i, incarnation: WorldLearner(journal), 1)
    rollouts = LocalGroup("rollout", backend, lambda i, incarnation: WorldEngine(
        journal, f"rollout-{i}" + (f"#{incarnation}" if incarnation else ""), starting(i)), engines)
    return NcclSync(learners, rollouts, "bfloat16", 2**20, timeout_s=1234.0, verify=False,
                    workers_per_engine=workers), rollouts


def test_the_nccl_world_forms_only_once_every_engine_is_constructed():
    """Every engine answers its version (its constructor is done) before learner 0 opens the world's rendezvous,
    which then waits cluster.sync_timeout_s for the ranks (not vLLM's 300 s)."""
    journal = Journal()
    nccl_world(journal, engines=3)
    whats = [what for _, what, _ in journal.entries]
    assert whats == ["version"] * 3 + ["connect"] * 4
    assert journal.of("connect") == [
        ("learner-0", ("127.0.0.1", 29500, 0, 4, 1234.0)),
        *[(f"rollout-{i}", ("127.0.0.1", 29500, i + 1, 4, 1234.0)) for i in range(3)]]


def test_each_worker_of_a_tensor_parallel_engine_is_a_rank_of_the_world():
    """Three engines of two workers each: learner 0 is rank 0, engine i's workers ranks 1 + 2i and 2 + 2i (each
    engine is told its first; its workers add their own rank in the engine), a world of 7."""
    journal = Journal()
    nccl_world(journal, engines=3, workers=2)
    assert journal.of("connect") == [
        ("learner-0", ("127.0.0.1", 29500, 0, 7, 1234.0)),
        *[(f"rollout-{i}", ("127.0.0.1", 29500, 1 + 2 * i, 7, 1234.0)) for i in range(3)]]


def test_an_engine_that_does_not_start_in_time_names_itself_before_any_rank_connects():
    journal = Journal()
    with pytest.raises(TimeoutError, match=r"the start-up of rollout-0, rollout-1 before the NCCL weight-sync group "
                                           r"forms has not returned within cluster\.sync_timeout_s = 1234 s"):
        nccl_world(journal, backend=Stalling(), starting=lambda i: "hangs" if i == 1 else 0)
    assert not journal.of("connect")


def test_the_communicator_waits_the_timeout_it_is_given_for_the_ranks(monkeypatch):
    """`make_communicator` hands vLLM's StatelessProcessGroup the timeout as its `store_timeout` (whole seconds)."""
    from vllm.distributed import utils
    from vllm.distributed.device_communicators import pynccl

    made: list[dict] = []
    monkeypatch.setattr(utils.StatelessProcessGroup, "create", staticmethod(lambda **kw: made.append(kw) or "group"))
    monkeypatch.setattr(pynccl, "PyNcclCommunicator", lambda group, device: (group, device))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert nccl.make_communicator("10.0.0.1", 29501, 2, 3, 1800.5) == ("group", 0)
    assert made == [{"host": "10.0.0.1", "port": 29501, "rank": 2, "world_size": 3, "store_timeout": 1801}]


# ----------------------------------------------------------------------------- a push that does not block (N5)
def test_an_nccl_push_returns_at_once_and_finish_watches_the_broadcast():
    """`start` submits the broadcast and the receives and returns without waiting (the asynchronous loop's driver
    goes on); `finish` waits for learner 0's broadcast with the engines' loads and returns their versions."""
    journal = Journal(hangs=True)
    sync, _ = nccl_world(journal, backend=Stalling())
    pending = sync.start(4)  # learner 0's broadcast never ends, and start does not wait for it
    assert pending.broadcast is not None and set(pending.handles) == {0, 1}
    assert [what for _, what, _ in journal.entries[-3:]] == ["send", "receive", "receive"]
    with pytest.raises(RuntimeError, match=r"weight sync \(NCCL\): not finished within cluster\.sync_timeout_s = "
                                           r"1234 s: learner 0's broadcast$"):
        sync.finish(pending)

    journal = Journal()
    sync, engines = nccl_world(journal)
    stats = sync.finish(sync.start(5))
    assert stats.lost == {} and [e.served for e in engines.workers] == [5, 5]


def test_an_nccl_push_that_a_dead_engine_holds_up_ends_with_its_name():
    journal = Journal(hangs=True, dies=frozenset({"rollout-1"}))
    sync, _ = nccl_world(journal, backend=Stalling())
    with pytest.raises(RuntimeError, match=r"weight sync \(NCCL\): rollout-1 failed during a broadcast, which cannot "
                                           r"go on without it .*: rollout-1 died"):
        sync.finish(sync.start(2))


# ------------------------------------------------------------------- replacing an engine under NCCL sync
def test_a_replacement_joins_a_new_nccl_world_and_every_engine_gets_the_current_weights():
    """Engine 1 dies and is restarted: once the new engine is constructed, learner 0 and every engine form the world
    again on a fresh port (the new engine in rank 2), and learner 0 broadcasts its current weights (version 3) to
    every engine: a broadcast needs every rank."""
    journal = Journal()
    sync, engines = nccl_world(journal)
    sync.push(2)
    sync.learners.workers[0].updates = 3
    engines.restart(1)
    before = len(journal.entries)
    handle = sync.push_one(1)
    assert journal.entries[before:] == [
        ("rollout-0", "version", ()), ("rollout-1#1", "version", ()),
        ("learner-0", "connect", ("127.0.0.1", 29501, 0, 3, 1234.0)),
        ("rollout-0", "connect", ("127.0.0.1", 29501, 1, 3, 1234.0)),
        ("rollout-1#1", "connect", ("127.0.0.1", 29501, 2, 3, 1234.0)),
        ("learner-0", "send", ()), ("rollout-0", "receive", (3,)), ("rollout-1#1", "receive", (3,))]
    assert sync.backend.get(handle) == 3 and [e.served for e in engines.workers] == [3, 3]
    assert sync.members == {0: 0, 1: 1} and sync.port == 29501

    # The next push goes to every engine, the one being replaced too (it is in the world); asked again for engine 1
    # (a push overtook its load), the sync broadcasts again without forming a new world.
    before = len(journal.entries)
    assert sync.finish(sync.start(4, skip={1})).lost == {}
    assert sync.backend.get(sync.push_one(1)) == 3
    assert [what for _, what, _ in journal.entries[before:]] == ["send", "receive", "receive"] * 2


def test_a_dead_engine_is_replaced_in_the_run_and_serves_the_current_weights():
    """The producer replaces an engine that died in generation through the NCCL sync's `push_one`: the replacement
    serves learner 0's current version and takes chunks again."""
    from distrl.cluster.producer import Producer
    from distrl.config import RecoveryConfig, RewardConfig
    from distrl.data.stream import PromptStream
    from distrl.types.prompt import Prompt
    from tests.one_turn import one_turn

    class Generating(WorldEngine):
        def generate(self, prompts: list, groups: list[int]):
            if self.name in self.journal.dies:
                raise ActorLost(f"{self.name} was killed")
            k = len(prompts)
            return one_turn(prompt_ids=[p.prompt_ids for p in prompts], response_ids=[[3]] * k,
                            rollout_logprobs=[[-0.5]] * k, response_texts=["2"] * k, finish_reasons=["stop"] * k,
                            group=list(groups), policy_version=[self.served] * k)

    journal = Journal(dies=frozenset({"rollout-1"}))
    backend = LocalBackend()
    learners = LocalGroup("learner", backend, lambda i, incarnation: WorldLearner(journal), 1)
    engines = LocalGroup("rollout", backend, lambda i, incarnation: Generating(
        journal, f"rollout-{i}" + (f"#{incarnation}" if incarnation else "")), 2)
    sync = NcclSync(learners, engines, "bfloat16", 2**20, timeout_s=60.0, verify=False)
    learners.workers[0].updates = 3
    journal.dies = frozenset()  # the first push reaches both engines
    sync.push(3)
    journal.dies = frozenset({"rollout-1"})  # engine 1 dies in its next generation
    stream = PromptStream([Prompt(i, "1+1=", [1, 2], answer="2") for i in range(8)], seed=0, shuffle=False)
    producer = Producer(engines, stream, RewardConfig(), prompts_per_step=4, max_staleness=0, chunk_prompts=None,
                        dynamic_sampling=None, load_weights=sync.push_one, recovery=RecoveryConfig(),
                        call_timeout_s=60.0, version=3)
    batch, stats = producer.next_batch(step=4)
    assert stats.rollout_restarts == 1 and stats.redispatched_prompts == 2
    assert sorted(batch.rollouts.group) == [0, 1, 2, 3] and set(batch.rollouts.policy_version) == {3}
    assert engines.name(1) == "rollout-1 (replacement 1)" and engines.workers[1].served == 3
    assert sync.members == {0: 0, 1: 1} and len(journal.of("connect")) == 6  # two worlds of three ranks


def test_a_second_dead_engine_when_the_world_forms_again_ends_the_run_saying_so():
    """Engine 1 is replaced while engine 0 is dead too (not yet noticed): no rank connects (a world of ranks that
    cannot all join would leave the others waiting), and the error says why the run cannot go on."""

    class Dead(WorldEngine):
        def version(self) -> int:
            raise ActorLost(f"{self.name} died")

    journal = Journal()
    sync, engines = nccl_world(journal)
    engines.workers[0] = Dead(journal, "rollout-0")
    engines.restart(1)
    connects = len(journal.of("connect"))
    with pytest.raises(RuntimeError, match=r"weight sync \(NCCL\): rollout-1 \(replacement 1\) was to join a new "
                                           r"NCCL world, but rollout-0 is dead too.*rollout-0 died"):
        sync.push_one(1)
    assert len(journal.of("connect")) == connects


def test_a_replacement_that_dies_starting_fails_its_load_and_is_replaced_again():
    """Only the new engine is dead: no world forms, and the handle push_one returns fails with its death, which the
    producer takes as a death of that engine (within its restart budget)."""

    class DiesStarting(WorldEngine):
        def version(self) -> int:
            raise ActorLost(f"{self.name} died starting")

    journal = Journal()
    sync, engines = nccl_world(journal)
    engines.restart(1)
    engines.workers[1] = DiesStarting(journal, "rollout-1#1")
    connects = len(journal.of("connect"))
    handle = sync.push_one(1)
    with pytest.raises(ActorLost, match="rollout-1#1 died starting"):
        sync.backend.get(handle)
    assert len(journal.of("connect")) == connects and sync.members == {0: 0, 1: 0}


# ------------------------------------------------------- engines let go and added while the run goes on (issue 28)
def test_an_engine_let_go_leaves_the_nccl_world_before_the_next_broadcast():
    """Of three engines, engine 1 is let go (its node lost, above cluster.rollout.min_actors): the next push forms
    the world again with learner 0 and engines 0 and 2 only, in ranks 1 and 2, and broadcasts to them."""
    journal = Journal()
    sync, engines = nccl_world(journal, engines=3)
    engines.retire(1)
    before = len(journal.entries)
    assert sync.finish(sync.start(2)).lost == {}
    assert journal.entries[before:] == [
        ("learner-0", "connect", ("127.0.0.1", 29501, 0, 3, 1234.0)),
        ("rollout-0", "connect", ("127.0.0.1", 29501, 1, 3, 1234.0)),
        ("rollout-2", "connect", ("127.0.0.1", 29501, 2, 3, 1234.0)),
        ("learner-0", "send", ()), ("rollout-0", "receive", (2,)), ("rollout-2", "receive", (2,))]
    assert sync.members == {0: 0, 2: 0}


def test_an_engine_added_joins_the_nccl_world_and_every_engine_gets_the_current_weights():
    """An engine added while the run goes on (index 2) loads its first weights through `push_one`, as a
    replacement does: the world forms again with it in rank 3, and learner 0 broadcasts its current version."""
    journal = Journal()
    sync, engines = nccl_world(journal)
    sync.push(1)
    sync.learners.workers[0].updates = 2
    assert engines.add() == 2 and engines.active() == [0, 1, 2]
    handle = sync.push_one(2)
    assert sync.backend.get(handle) == 2 and [e.served for e in engines.workers] == [2, 2, 2]
    assert sync.members == {0: 0, 1: 0, 2: 0}
    assert journal.of("connect")[-4:] == [("learner-0", ("127.0.0.1", 29501, 0, 4, 1234.0)),
                                          ("rollout-0", ("127.0.0.1", 29501, 1, 4, 1234.0)),
                                          ("rollout-1", ("127.0.0.1", 29501, 2, 4, 1234.0)),
                                          ("rollout-2", ("127.0.0.1", 29501, 3, 4, 1234.0))]


def test_an_object_store_push_skips_engines_let_go():
    backend = LocalBackend()
    learners = LocalGroup("learner", backend, lambda i, incarnation: FakeLearner(), 1)
    engines = LocalGroup("rollout", backend, lambda i, incarnation: FakeEngine(hangs=False), 3)
    sync = ObjectStoreSync(learners, engines, "float32", 2**20, timeout_s=5, verify=False)
    engines.retire(0)
    assert set(sync.start(3).handles) == {1, 2}
