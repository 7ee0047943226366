"""Actor groups: N workers of one plain class, with typed fan-out. Two backends behind one API:

- `RayGroup`: N Ray actors placed in a placement group. `ray.remote` is applied when the group is created
  (`start_group`, through `RayBackend.actors`), with resources from config; worker classes never know about Ray.
  Actors are named `distrl/<run>/<role>-<index>` so the Ray dashboard's actor list reads by role.
- `LocalGroup`: N worker instances in the driver's process. A call runs at once and returns a resolved `Done`
  handle, so the driver's loop runs unchanged, in seconds, under a debugger.

A worker can be replaced (`restart(i)`): the old one is ended and a new one built the way the first was, on the same
placement bundle. Each replacement bumps the worker's incarnation, so a failure reported for an older incarnation is
recognised as already dealt with.

Calls name the worker's method object (`group.map(ReferenceWorker.logprobs, shards)`), never a string, so renaming
a method is a refactor, not a runtime error. Handles are resolved by the group's `Backend` (`get`, `wait`).

`start_group` creates a role's group: it asks the backend for the role's workers (`Backend.actors`), each on its
bundle of the role's `Placement`. Above `distrl.cluster.backend` and `distrl.cluster.placement`; neither imports it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from distrl.cluster.backend import Backend, Done, Init, Make, RayBackend
from distrl.cluster.placement import Placement
from distrl.config import RoleResources

W = TypeVar("W")


def method_name(method: Callable) -> str:
    name = getattr(method, "__name__", None)
    if name is None or name.startswith("_"):
        raise TypeError(f"pass a public worker method such as Worker.update, got {method!r}")
    return name


class ActorGroup(ABC, Generic[W]):
    """A role's workers. Calls return handles (Ray ObjectRefs or `Done`); the driver decides when to wait."""

    def __init__(self, role: str, backend: Backend, make: Make, size: int, placement: Placement | None = None):
        self.role = role
        self.backend = backend
        self.placement = placement
        self._make = make
        self.incarnations = [0] * size
        self.workers: list[Any] = [make(i, 0) for i in range(size)]
        self.retired: set[int] = set()

    def __len__(self) -> int:
        """Workers ever started (retired ones too): indices run from 0 to len - 1."""
        return len(self.workers)

    def active(self) -> list[int]:
        """The indices of the workers not let go (`retire`)."""
        return [i for i in range(len(self.workers)) if i not in self.retired]

    def add(self) -> int:
        """Start one more worker, built as the others were, on the next bundle of the placement (`Placement.add`
        reserved it); returns its index. Returns at once; calls to it wait until it is ready."""
        self.incarnations.append(0)
        self.workers.append(self._make(len(self.workers), 0))
        return len(self.workers) - 1

    def retire(self, index: int) -> None:
        """Let worker `index` go for good (its process ended if anything is left of it, and its resources given back
        when they were its alone): it is no longer among `active()`, and calls no longer go to it."""
        self._end(self.workers[index])
        self.retired.add(index)
        if self.placement is not None:
            self.placement.release(index)

    def name(self, index: int) -> str:
        """How logs and errors name worker `index`: its role, index and, once replaced, incarnation."""
        return f"{self.role}-{index}" + (f" (replacement {self.incarnations[index]})" if self.incarnations[index]
                                         else "")

    def restart(self, index: int) -> None:
        """End worker `index` (if anything is left of it) and start a new one in its place, built as the first was.
        Returns at once; calls to the new worker wait until it is ready."""
        self._end(self.workers[index])
        self.incarnations[index] += 1
        self.workers[index] = self._make(index, self.incarnations[index])

    @abstractmethod
    def _end(self, worker: Any) -> None:
        """End one worker now, without waiting for its calls in flight."""

    @abstractmethod
    def dead(self) -> list[int]:
        """The workers whose process is gone. A worker still busy with a call counts as alive."""

    def verdict(self, index: int) -> bool | None:
        """The cluster's word on worker `index`, asked after it could not be reached (its node may be lost and not
        yet declared): True if declared dead, False if it answers again, None while neither. A worker in this
        process that failed is gone."""
        return True

    def lost(self, index: int, error: BaseException) -> bool:
        """Whether `error`, raised by a call to worker `index` (as it is now or was before a restart: a push sent
        to an engine that was replaced before the push was waited for), says that that worker's process is gone:
        not that the call raised, nor that another actor whose result it took died (learner 0, whose weights a
        push carries, fails every engine's load with its own death)."""
        return self.backend.lost(error) and self._names(index, error)

    def _names(self, index: int, error: BaseException) -> bool:
        return True

    @abstractmethod
    def call(self, index: int, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """`method(*args, **kwargs)` on worker `index`; handles among `args` are resolved first."""

    @abstractmethod
    def kill(self) -> None:
        """Stop every worker now, without waiting for calls in flight."""

    @abstractmethod
    def node_ip(self, index: int) -> str:
        """IP address of the node worker `index` runs on."""

    def map(self, method: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """The same call on every active worker."""
        return [self.call(i, method, *args, **kwargs) for i in self.active()]

    def map_shards(self, method: Callable, shards: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Active worker i (in order) gets `shards[i]` as first argument; there must be one shard per active
        worker."""
        active = self.active()
        if len(shards) != len(active):
            raise ValueError(f"{self.role}: {len(shards)} shards for {len(active)} workers")
        return [self.call(i, method, shard, *args, **kwargs) for i, shard in zip(active, shards, strict=True)]


class RayGroup(ActorGroup[W]):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._pings: dict[int, tuple[Any, Any]] = {}  # index -> (the actor asked, the ping `verdict` reads)
        self._former_ids: dict[int, set[str]] = {}  # index -> the actor ids it held before its restarts

    def restart(self, index: int) -> None:
        self._former_ids.setdefault(index, set()).add(self.workers[index]._actor_id.hex())
        self._pings.pop(index, None)
        super().restart(index)

    def retire(self, index: int) -> None:
        self._pings.pop(index, None)
        super().retire(index)

    def call(self, index: int, method: Callable, *args: Any, **kwargs: Any) -> Any:
        # Top-level ObjectRef arguments are resolved by Ray before the call runs.
        return getattr(self.workers[index], method_name(method)).remote(*args, **kwargs)

    def node_ip(self, index: int) -> str:
        """IP address of the node actor `index` runs on."""
        import ray

        return ray.get(self.workers[index].__ray_call__.remote(lambda _: ray.util.get_node_ip_address()))

    def kill(self) -> None:
        # Without waiting: a learner blocked in a collective whose peer died would otherwise hold teardown until
        # the collective times out.
        for i in self.active():
            self._end(self.workers[i])

    def _end(self, worker: Any) -> None:
        import ray

        ray.kill(worker, no_restart=True)  # a no-op for an actor that is already dead

    def dead(self, timeout: float = 10.0) -> list[int]:
        import ray
        from ray.exceptions import RayActorError

        pings = {i: self.workers[i].__ray_ready__.remote() for i in self.active()}
        # A dead actor's ping fails at once; a busy one's waits behind its call (one at a time), so one bounded
        # wait for all of them, and those still pending count as alive.
        done, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=timeout)
        gone = []
        for i, ping in pings.items():
            if ping in done:
                try:
                    ray.get(ping)
                except RayActorError:
                    gone.append(i)
        return gone

    def verdict(self, index: int) -> bool | None:
        import ray
        from ray.exceptions import ActorDiedError, RayActorError

        # One ping in flight per worker, looked at without waiting: it fails with ActorDiedError once Ray has declared
        # the actor dead, and is answered if the worker can be reached again; unanswered or failing as unavailable:
        # no word yet.
        worker = self.workers[index]
        asked, ping = self._pings.get(index, (None, None))
        if asked is not worker:  # never asked, or asked of an actor since replaced
            ping = worker.__ray_ready__.remote()
            self._pings[index] = (worker, ping)
        ready, _ = ray.wait([ping], timeout=0)
        if not ready:
            return None
        del self._pings[index]
        try:
            ray.get(ping)
        except ActorDiedError:
            return True
        except RayActorError:
            return None
        return False

    def _names(self, index: int, error: BaseException) -> bool:
        actor_id = getattr(error, "actor_id", None)
        return actor_id is None or actor_id in {self.workers[index]._actor_id.hex(), *self._former_ids.get(index, ())}


class LocalGroup(ActorGroup[W]):
    def call(self, index: int, method: Callable, *args: Any, **kwargs: Any) -> Done:
        try:
            args = tuple(self.backend.get(a) if isinstance(a, Done) else a for a in args)
            return Done(getattr(self.workers[index], method_name(method))(*args, **kwargs))
        except Exception as err:  # noqa: BLE001 - handed back like a Ray task error, raised by `get`
            return Done(error=err)

    def node_ip(self, index: int) -> str:
        """Every worker runs in this process, on this machine."""
        return "127.0.0.1"

    def kill(self) -> None:
        self.workers.clear()

    def _end(self, worker: Any) -> None:
        pass  # an instance in this process: dropping it is all there is

    def dead(self) -> list[int]:
        return []  # in this process: a worker that "dies" (a test's fake) raises ActorLost from its call


def start_group(backend: Backend, worker: type, role: str, resources: RoleResources, placement: Placement | None, *,
                run_name: str, init: Init, env: dict[str, str], concurrency: int = 1,
                self_restarts: int = 0) -> ActorGroup:
    """Start `resources.num_actors` workers of `worker` for `role` on `backend`: Ray actors on the bundles of
    `placement` (a `RayGroup`), or instances in this process (a `LocalGroup`, no placement). `concurrency` and
    `self_restarts`: see `Backend.actors`."""
    make = backend.actors(worker, role, resources, run_name=run_name, init=init, env=env,
                          scheduling=placement.scheduling if placement is not None else None,
                          concurrency=concurrency, self_restarts=self_restarts)
    kind: type[ActorGroup] = RayGroup if isinstance(backend, RayBackend) else LocalGroup
    return kind(role, backend, make, resources.num_actors, placement)
