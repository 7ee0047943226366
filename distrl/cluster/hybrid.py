"""Hybrid mode (`cluster.colocate: hybrid`) seen from the driver: one group of `HybridWorker` actors, each a learner
with its own engine and reference, shown to the loops as the usual role groups (`RoleView`), and the weight sync
that loads each actor's engine from its own learner, in memory (`HybridSync`).

A view's calls go to the same actors, so they keep the order the driver sends them in: a hybrid actor runs one call
at a time. Its engine cannot be replaced apart from its learner: a dead hybrid actor is a learner death, which the
run recovers from its newest checkpoint (`distrl.loop.recovery`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distrl.cluster.group import ActorGroup, RayGroup, method_name
from distrl.cluster.weight_sync import WeightSync
from distrl.workers.hybrid import HybridWorker


class RoleView(ActorGroup):
    """Part `part` ("learner", "rollout", "reference") of every actor of a hybrid group, as a group of that role:
    `call(i, Learner.update, ...)` runs `HybridWorker.run("learner", "update", ...)` on actor i. Deaths, names,
    restarts and incarnations are the actors' own."""

    def __init__(self, hybrids: ActorGroup[HybridWorker], part: str):
        self.hybrids, self.part = hybrids, part
        self.role, self.backend, self.placement = hybrids.role, hybrids.backend, None

    @property  # the actors' own list, which a restart updates
    def incarnations(self) -> list[int]:  # type: ignore[override]
        return self.hybrids.incarnations

    @property
    def workers(self) -> list[Any]:  # type: ignore[override]
        return self.hybrids.workers

    @property
    def retired(self) -> set[int]:  # type: ignore[override]
        return self.hybrids.retired

    def __len__(self) -> int:
        return len(self.hybrids)

    def name(self, index: int) -> str:
        return self.hybrids.name(index)

    def call(self, index: int, method: Callable, *args: Any, **kwargs: Any) -> Any:
        return self.hybrids.call(index, HybridWorker.run, self.part, method_name(method), *args, **kwargs)

    def restart(self, index: int) -> None:
        raise RuntimeError(f"{self.name(index)} hosts a learner: it cannot be replaced alone, the run recovers from "
                           f"its newest checkpoint")

    def _end(self, worker: Any) -> None:
        self.hybrids._end(worker)

    def dead(self) -> list[int]:
        return self.hybrids.dead()

    def lost(self, index: int, error: BaseException) -> bool:
        return self.hybrids.lost(index, error)

    def kill(self) -> None:
        self.hybrids.kill()

    def node_ip(self, index: int) -> str:
        assert isinstance(self.hybrids, RayGroup)
        return self.hybrids.node_ip(index)


class HybridSync(WeightSync):
    """Each hybrid actor loads its own learner's weights into its engine, in memory (`HybridWorker.push`); the
    fingerprint check that follows is the usual one (learner 0's fingerprint, every engine's own read of what it
    serves)."""

    replaceable = False
    unreplaceable = ("a hybrid actor's engine shares its process with a learner: its death is the learner's, and the "
                     "run recovers from its newest checkpoint (cluster.recovery.max_recoveries)")

    def __init__(self, hybrids: ActorGroup[HybridWorker], learners: ActorGroup, rollouts: ActorGroup, dtype: str,
                 bucket_bytes: int, timeout_s: float, verify: bool):
        self.hybrids = hybrids
        super().__init__(learners, rollouts, dtype, bucket_bytes, timeout_s, verify)

    def push_one(self, index: int) -> Any:
        raise RuntimeError(self.unreplaceable)

    def _load(self, version: Any, to: list[int]) -> list[Any]:
        assert len(to) == len(self.hybrids), "every hybrid actor loads every push (sharded learners gather together)"
        return self.hybrids.map(HybridWorker.push, version)
