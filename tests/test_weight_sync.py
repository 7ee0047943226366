"""Weight pushes stream into the engines and have a time limit.

- An engine takes in one bucket at a time, as its reload reaches it, over the object store and over NCCL (a fake
  communicator on CPU): the previous bucket is gone before the next one is fetched or received.
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
from distrl.workers import nccl
from distrl.workers.engine_loop import EngineLoop
from distrl.workers.rollout import RolloutWorker, Served, UnusableEngine


class FakeLearner:
    def weight_specs(self, bucket_bytes: int, dtype: str) -> list:
        return [[("w", (2,))]]

    def weight_bucket(self, spec: list, dtype: str) -> dict[str, torch.Tensor]:
        return {"w": torch.zeros(2)}


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


def nccl_sync(backend: LocalBackend, engines: LocalGroup) -> NcclSync:
    """An NcclSync without its NCCL world (its constructor needs GPUs): only the waiting is under test."""
    sync = NcclSync.__new__(NcclSync)
    sync.backend, sync.rollouts, sync.timeout_s = backend, engines, 5.0
    return sync


def test_an_nccl_broadcast_ends_when_a_receiver_fails_or_time_runs_out():
    backend = Stalling()
    engines = LocalGroup("rollout", backend, lambda i, incarnation: FakeEngine(hangs=False), 2)
    sync = nccl_sync(backend, engines)
    with pytest.raises(RuntimeError, match=r"weight sync \(NCCL\): rollout-1 failed during a broadcast, which "
                                           r"cannot go on without it .*: the engine died"):
        sync._broadcast_done(Done("hangs"), [Done(1), Done(error=ActorLost("the engine died"))])
    with pytest.raises(RuntimeError, match=r"not finished within cluster\.sync_timeout_s = 5 s: learner 0's "
                                           r"broadcast, rollout-0$"):
        sync._broadcast_done(Done("hangs"), [Done("hangs"), Done(1)])
    sync._broadcast_done(Done(None), [Done(1), Done(1)])  # every part done: returns


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
    """Stands for `vllm.LLM` in a RolloutWorker: its reload copies each tensor into its own weights and lets go of
    it."""

    def __init__(self, fail_after: int | None = None):
        self.weights: dict[str, torch.Tensor] = {}
        self.fail_after = fail_after

    def collective_rpc(self, method: str, kwargs: dict) -> list:
        assert method == "reload_weights" and kwargs["is_checkpoint_format"]
        for name, tensor in kwargs["weights_iterator"]:  # (enumerate would keep the last pair alive)
            if len(self.weights) == self.fail_after:
                raise RuntimeError("the reload failed")
            self.weights[name] = tensor.clone()
            del tensor  # as vLLM's loader does once a layer is processed
        return [None]

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        pass


def worker(llm: FakeLLM) -> RolloutWorker:
    """A RolloutWorker around a fake engine (the real constructor starts vLLM) on an engine thread of its own."""
    engine = RolloutWorker.__new__(RolloutWorker)
    engine.engine = EngineLoop(lambda: llm)
    engine.llm, engine.served, engine._torn, engine.on_gpu, engine.lora = llm, Served(), None, False, None
    engine.stepper = SimpleNamespace(in_flight=0)
    return engine


def bucket(i: int, per_bucket: int) -> dict[str, torch.Tensor]:
    """Bucket i: `per_bucket` tensors of shape [3]; tensor j is full of 10 * i + j."""
    return {f"b{i}.t{j}": torch.full((3,), 10.0 * i + j) for j in range(per_bucket)}


def made_one_by_one(alive: Alive, buckets: int, per_bucket: int, peaks: list[int]
                    ) -> Iterator[dict[str, torch.Tensor]]:
    """The buckets, each made only when asked for (as a fetch from the object store is), its tensors tracked; once
    each is made, how many tracked tensors are alive goes into `peaks`."""
    for i in range(buckets):
        made = {name: tracked(t, alive) for name, t in bucket(i, per_bucket).items()}
        peaks.append(count(alive))
        yield made
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

        def weight_bucket(self, spec: list, dtype: str) -> dict[str, torch.Tensor]:
            return bucket(int(spec[0][0][1]), 2)

    llms = [FakeLLM(), FakeLLM()]
    learners = LocalGroup("learner", backend, lambda i, incarnation: Learner2(), 1)
    engines = LocalGroup("rollout", backend, lambda i, incarnation: worker(llms[i]), 2)
    ObjectStoreSync(learners, engines, "float32", 24, timeout_s=5, verify=False).push(2)
    for llm in llms:  # every engine got every tensor (the buckets are shared, not emptied by the first engine)
        assert {name: t[0].item() for name, t in llm.weights.items()} == {
            name: v for name, v in SENT.items() if name < "b2"}

    failed = StreamedBuckets([Done({"a": torch.zeros(1)}), Done(error=ActorLost("learner 0 died"))])
    with pytest.raises(ActorLost, match="learner 0 died"):
        list(failed)


def test_a_load_that_fails_midway_leaves_an_engine_that_refuses_work():
    engine = worker(FakeLLM(fail_after=3))
    with pytest.raises(RuntimeError, match="the reload failed"):
        engine.load_weights(5, made_one_by_one([], 3, 2, []))
    assert engine.version() == 0  # version 5 was never served
    why = r"this rollout engine cannot serve: loading the weights of version 5 failed midway: .*; it must be replaced"
    calls: list[Callable[[], Any]] = [lambda: engine.generate([], []), lambda: engine.score([[1, 2]], 1),
                                      lambda: engine.check_weights(5, {}, "rollout-0"),
                                      lambda: engine.load_weights(6, [])]
    for call in calls:
        with pytest.raises(UnusableEngine, match=why):
            call()


class Stops(FakeLLM):
    def collective_rpc(self, method: str, kwargs: dict) -> list:
        next(iter(kwargs["weights_iterator"]))
        return [None]


def test_a_reload_that_stops_before_the_last_tensor_is_an_error():
    engine = worker(Stops())
    with pytest.raises(RuntimeError, match="reload of version 1 stopped before the last tensor"):
        engine.load_weights(1, [{"a": torch.zeros(1), "b": torch.zeros(1)}])


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


def test_an_nccl_push_receives_each_bucket_when_the_reload_reaches_it():
    specs = [[(f"b{i}.t{j}", (3,)) for j in range(2)] for i in range(3)]
    sender = Sender()
    for i in range(3):
        nccl.send_bucket(sender, bucket(i, 2), torch.device("cpu"))
    assert [t.tolist() for t in sender.sent][1] == [10.0] * 3 + [11.0] * 3  # a bucket travels flat
    llm = FakeLLM()
    engine = worker(llm)
    engine._nccl, engine._nccl_device = receiver, _ = Receiver(sender.sent), torch.device("cpu")
    assert engine.nccl_receive(3, specs, "float32") == 3
    assert {name: t.tolist() for name, t in llm.weights.items()} == {name: [float(v)] * 3 for name, v in SENT.items()}
    # One received buffer at a time: bucket 0's was freed before bucket 1's was allocated (receiving all buckets
    # before loading gives [1, 2, 3]; holding on to the last one, [1, 2, 2]).
    assert receiver.peaks == [1, 1, 1]
    assert count(receiver.alive) == 0
