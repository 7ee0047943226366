"""Actor groups: N workers of one plain class, with typed fan-out. Two backends behind one API:

- `RayGroup`: N Ray actors placed in a placement group. `ray.remote` is applied here, when the group is created,
  with resources from config; worker classes never know about Ray. Actors are named `distrl/<run>/<role>-<index>`
  so the Ray dashboard's actor list reads by role.
- `LocalGroup`: N worker instances in the driver's process. A call runs at once and returns a resolved `Done`
  handle, so the driver's loop runs unchanged, in seconds, under a debugger.

Calls name the worker's method object (`group.map(ReferenceWorker.logprobs, shards)`), never a string, so renaming
a method is a refactor, not a runtime error. Handles are resolved by the group's `Backend` (`get`, `wait`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

    from distrl.cluster.backend import Backend

W = TypeVar("W")


@dataclass
class Placement:
    """Where a role's Ray actors go: a placement group and the bundle index of each actor."""

    group: PlacementGroup
    bundle_indices: list[int]


@dataclass(eq=False)  # compared and hashed by identity, like a Ray ObjectRef
class Done:
    """A local call's outcome, already there: its value, or the exception it raised (raised again by `get`)."""

    value: Any = None
    error: BaseException | None = None


def method_name(method: Callable) -> str:
    name = getattr(method, "__name__", None)
    if name is None or name.startswith("_"):
        raise TypeError(f"pass a public worker method such as Worker.update, got {method!r}")
    return name


class ActorGroup(ABC, Generic[W]):
    """A role's workers. Calls return handles (Ray ObjectRefs or `Done`); the driver decides when to wait."""

    def __init__(self, role: str, backend: Backend):
        self.role = role
        self.backend = backend

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def call(self, index: int, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """`method(*args, **kwargs)` on worker `index`; handles among `args` are resolved first."""

    @abstractmethod
    def kill(self) -> None:
        """Stop every worker now, without waiting for calls in flight."""

    def map(self, method: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """The same call on every worker."""
        return [self.call(i, method, *args, **kwargs) for i in range(len(self))]

    def map_shards(self, method: Callable, shards: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Worker i gets `shards[i]` as first argument; there must be one shard per worker."""
        if len(shards) != len(self):
            raise ValueError(f"{self.role}: {len(shards)} shards for {len(self)} workers")
        return [self.call(i, method, shard, *args, **kwargs) for i, shard in enumerate(shards)]


class RayGroup(ActorGroup[W]):
    def __init__(self, role: str, backend: Backend, actors: list[Any]):
        super().__init__(role, backend)
        self.actors = actors

    def __len__(self) -> int:
        return len(self.actors)

    def call(self, index: int, method: Callable, *args: Any, **kwargs: Any) -> Any:
        # Top-level ObjectRef arguments are resolved by Ray before the call runs.
        return getattr(self.actors[index], method_name(method)).remote(*args, **kwargs)

    def node_ip(self, index: int) -> str:
        """IP address of the node actor `index` runs on."""
        import ray

        return ray.get(self.actors[index].__ray_call__.remote(lambda _: ray.util.get_node_ip_address()))

    def kill(self) -> None:
        # Without waiting: a learner blocked in a collective whose peer died would otherwise hold teardown until
        # the collective times out.
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)


class LocalGroup(ActorGroup[W]):
    def __init__(self, role: str, backend: Backend, workers: list[W]):
        super().__init__(role, backend)
        self.workers = workers

    def __len__(self) -> int:
        return len(self.workers)

    def call(self, index: int, method: Callable, *args: Any, **kwargs: Any) -> Done:
        try:
            args = tuple(self.backend.get(a) if isinstance(a, Done) else a for a in args)
            return Done(getattr(self.workers[index], method_name(method))(*args, **kwargs))
        except Exception as err:  # noqa: BLE001 - handed back like a Ray task error, raised by `get`
            return Done(error=err)

    def kill(self) -> None:
        self.workers.clear()
