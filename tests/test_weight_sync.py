"""Weight pushes have a time limit: an engine that does not load the weights, or an NCCL broadcast that a dead or
hung peer holds up, ends the run naming who did not finish, instead of a wait without end."""

from typing import Any

import pytest
import torch

from distrl.cluster.backend import LocalBackend
from distrl.cluster.group import ActorLost, Done, LocalGroup
from distrl.cluster.weight_sync import NcclSync, ObjectStoreSync


class FakeLearner:
    def weight_specs(self, bucket_bytes: int, dtype: str) -> list:
        return [[("w", (2,))]]

    def weight_bucket(self, spec: list, dtype: str) -> dict[str, torch.Tensor]:
        return {"w": torch.zeros(2)}


class FakeEngine:
    def __init__(self, hangs: bool):
        self.hangs = hangs

    def load_weights(self, version: int, *buckets: Any) -> Any:
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
