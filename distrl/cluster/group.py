"""Actor groups: N Ray actors of one plain worker class, placed in a placement group, with typed fan-out.

`ray.remote` is applied here, when a group is created, with resources from config; worker classes never know about
Ray. Calls name the worker's method object (`group.map(ReferenceWorker.logprobs, shards)`), never a string, so
renaming a method is a refactor, not a runtime error.

Actors are named `distrl/<run>/<role>-<index>` so the Ray dashboard's actor list reads by role.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from distrl.config import RoleResources

W = TypeVar("W")


@dataclass
class Placement:
    """Where a role's actors go: a placement group and the bundle index of each actor."""

    group: PlacementGroup
    bundle_indices: list[int]


class ActorGroup(Generic[W]):
    """A role's actors. Methods return ObjectRefs; the driver decides when to wait."""

    def __init__(self, role: str, actors: list[ray.actor.ActorHandle]):
        self.role = role
        self.actors = actors

    def __len__(self) -> int:
        return len(self.actors)

    @classmethod
    def create(cls, worker: type[W], role: str, resources: RoleResources, placement: Placement, *,
               run_name: str, init: Callable[[int], tuple[tuple, dict]], env: dict[str, str] | None = None,
               ) -> ActorGroup[W]:
        """Start `resources.num_actors` actors of `worker`; `init(i)` gives actor i's constructor (args, kwargs)."""
        remote_cls = ray.remote(worker)
        actors: list[Any] = []  # Ray types a handle ActorHandle[W] | type[W], so that method calls type-check
        for i in range(resources.num_actors):
            args, kwargs = init(i)
            actors.append(remote_cls.options(
                name=f"distrl/{run_name}/{role}-{i}",
                num_cpus=resources.num_cpus,
                num_gpus=resources.num_gpus,
                runtime_env={"env_vars": dict(env or {})},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=placement.group, placement_group_bundle_index=placement.bundle_indices[i]),
                max_concurrency=1,
            ).remote(*args, **kwargs))
        return cls(role, actors)

    @staticmethod
    def _name(method: Callable) -> str:
        name = getattr(method, "__name__", None)
        if name is None or name.startswith("_"):
            raise TypeError(f"pass a public worker method such as Worker.update, got {method!r}")
        return name

    def call(self, index: int, method: Callable, *args: Any, num_returns: int = 1, **kwargs: Any):
        """`method(*args, **kwargs)` on actor `index`."""
        return getattr(self.actors[index], self._name(method)).options(num_returns=num_returns).remote(*args, **kwargs)

    def map(self, method: Callable, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """The same call on every actor."""
        return [self.call(i, method, *args, **kwargs) for i in range(len(self))]

    def map_shards(self, method: Callable, shards: Sequence[Any], *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Actor i gets `shards[i]` as first argument; there must be one shard per actor."""
        if len(shards) != len(self):
            raise ValueError(f"{self.role}: {len(shards)} shards for {len(self)} actors")
        return [self.call(i, method, shard, *args, **kwargs) for i, shard in enumerate(shards)]

    def node_ip(self, index: int) -> str:
        """IP address of the node actor `index` runs on."""
        return ray.get(self.actors[index].__ray_call__.remote(lambda _: ray.util.get_node_ip_address()))

    def kill(self) -> None:
        """Stop every actor now, without waiting for calls in flight (a learner blocked in a collective whose
        peer died would otherwise hold teardown until the collective times out)."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
