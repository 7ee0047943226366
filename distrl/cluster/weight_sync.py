"""Learner -> rollout weight sync, tagged with the policy version. Two transports behind one interface:

`ObjectStoreSync` (CPU, or any cluster): every learner casts the rows it holds to the rollout dtype, bucket by
bucket (`Learner.weight_pieces`: a replica's learner 0 sends every tensor whole; sharded learners each send their
own block, so that none sends or gathers the whole model); each piece is put in the Ray object store once and every
rollout actor reads the same objects, assembling each bucket's tensors from the pieces (one call per actor, not one
per tensor). An engine of k workers hands them each bucket through shared memory, each worker copying out its slice
(`distrl.workers.rollout.engine_weights`). `NcclSync` (GPU): learner 0 broadcasts the buckets over a dedicated NCCL
world to every worker of every engine.

Either way an engine takes in one bucket at a time, as its in-place reload reaches it (`StreamedBuckets`,
`nccl.receive_buckets`), so a push costs an engine one bucket beyond its steady state, plus the layer vLLM's reload
is processing, not a copy of the model (on a GPU: outside vLLM's memory budget). docs/BENCHMARKS.md measures it.

With `verify`, every load is followed by a check of the weights each worker of the engine then serves against the
learners' fingerprint of what they sent, region by region (`distrl.workers.weights.fingerprint`): a push resolves
only once its weights are verified.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from distrl.cluster.backend import Done
from distrl.cluster.group import ActorGroup, RayGroup
from distrl.console import say
from distrl.workers.model_files import DTYPES
from distrl.workers.rollout.worker import RolloutWorker
from distrl.workers.training.learner import Learner
from distrl.workers.weights.export import Spec
from distrl.workers.weights.fingerprint import Region
from distrl.workers.weights.pieces import BucketParts


@dataclass
class SyncStats:
    seconds: float
    bytes: int
    lost: dict[int, tuple[int, BaseException]] = field(default_factory=dict)
    """Engines that died before loading the weights: index -> (the incarnation pushed to, the error)."""

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


@dataclass
class PendingSync:
    """A push in flight: one handle per engine, resolving to the version it serves once loaded."""

    version: int
    handles: dict[int, Any]  # engine index -> its handle
    started: float
    incarnations: list[int]  # of the engines pushed to
    broadcast: Any = None
    """NCCL: learner 0's broadcast, which `finish` watches with the engines' loads (None over the object store)."""


class WeightSync(ABC):
    """Pushes learner 0's weights into every rollout engine. `push` returns when all engines serve `version`;
    `start` returns at once, over either transport: each engine loads the weights after the call it is running
    (actors take one call at a time, in submission order), so it switches versions between two generation chunks,
    and `finish` waits for them (in the asynchronous loop, one step later)."""

    def __init__(self, learners: ActorGroup[Learner], rollouts: ActorGroup[RolloutWorker], dtype: str,
                 bucket_bytes: int, timeout_s: float, verify: bool):
        self.learners, self.rollouts = learners, rollouts
        self.dtype, self.timeout_s, self.verify = dtype, timeout_s, verify
        self.backend = learners.backend
        self.specs = self.backend.answer(learners.call(0, Learner.weight_specs, bucket_bytes, dtype),
                                         "learner 0's weight layout", timeout_s, "cluster.sync_timeout_s")
        item = torch.empty((), dtype=DTYPES[dtype]).element_size()
        self.total_bytes = item * sum(math.prod(shape) for spec in self.specs for _, shape in spec)
        self.regions = self._regions() if verify else None

    def _regions(self) -> dict[str, list[Region]]:
        """The regions of the pushed tensors that the engines' workers hold (every engine has the same layout: one
        is asked), which the learners fingerprint for each check. Every pushed tensor must be held by some worker."""
        first = self.rollouts.active()[0]
        regions: dict[str, list[Region]] = self.backend.answer(
            self.rollouts.call(first, RolloutWorker.weight_regions), f"{self.rollouts.name(first)}'s weight layout",
            self.timeout_s, "cluster.sync_timeout_s")
        unheld = [name for spec in self.specs for name, _ in spec if name not in regions]
        if unheld:
            raise RuntimeError(f"weight sync: the engine serves no tensor named {unheld[0]} ({len(unheld)} of the "
                               f"pushed tensors), so no check could tell whether it was loaded "
                               f"(cluster.verify_weights=false turns the check off)")
        return regions

    def push(self, version: int, skip: set[int] | frozenset[int] = frozenset()) -> SyncStats:
        return self.finish(self.start(version, skip))

    def start(self, version: int, skip: set[int] | frozenset[int] = frozenset()) -> PendingSync:
        """Start pushing to every engine but those in `skip` (being replaced: they load the weights themselves
        once started, with `push_one`)."""
        to = [i for i in self.rollouts.active() if i not in skip]
        return PendingSync(version, dict(zip(to, self._transfer(version, to), strict=True)), time.perf_counter(),
                           list(self.rollouts.incarnations))

    def finish(self, pending: PendingSync) -> SyncStats:
        """Wait until every engine serves `pending.version`; the stats time the push from its start. An engine that
        died is not an error here: it is listed in `SyncStats.lost`, for the producer to replace."""
        lost: dict[int, tuple[int, BaseException]] = {}
        deadline = pending.started + self.timeout_s
        for i, handle in pending.handles.items():
            try:
                version = self.backend.get(handle, timeout=max(0.0, deadline - time.perf_counter()))
            except TimeoutError as err:
                raise RuntimeError(f"weight sync: {self.rollouts.name(i)} has not loaded (and verified) the weights "
                                   f"of version {pending.version} within cluster.sync_timeout_s = "
                                   f"{self.timeout_s:g} s of the push's start") from err
            except Exception as err:
                if not self.rollouts.lost(i, err):
                    raise
                lost[i] = (pending.incarnations[i], err)
                continue
            if version != pending.version:
                raise RuntimeError(f"weight sync: {self.rollouts.name(i)} reports version {version}, expected "
                                   f"{pending.version}")
        return SyncStats(time.perf_counter() - pending.started, self.total_bytes, lost)

    replaceable = True
    """Whether a new engine can take a dead one's place (`push_one`)."""
    unreplaceable = ""
    """Why not, when it cannot."""
    skips_engines = True
    """Whether a push can leave engines out (`start`'s `skip`): one that cannot be reached may then wait for Ray's
    verdict before it is replaced."""

    def push_one(self, index: int) -> Any:
        """Load learner 0's current weights into rollout actor `index` alone (a replacement); returns a handle that
        resolves to the version it then serves. The version is learner 0's own count of updates, asked in the same
        queue as the weights, so it names exactly the weights sent even while an update is in flight."""
        return self._transfer(self.learners.call(0, Learner.weights_version), [index])[0]

    def _transfer(self, version: Any, to: list[int]) -> list[Any]:
        """Start the transfer to engines `to`; returns one handle per engine resolving to the version it serves
        (once verified, with `verify`). `version` is a number or a handle resolving to one."""
        loads = self._load(version, to)
        if not self.verify or not to:
            return loads
        # Asked right after the weights themselves: each learner takes calls in order, so no update comes between.
        expected = self.learners.map(Learner.weights_fingerprint, self.dtype, self.regions)  # one part per learner
        # Each check takes its engine's load as an argument: it runs after the load, and a failed load fails it.
        return [self.rollouts.call(i, RolloutWorker.check_weights, load, self.rollouts.name(i), *expected)
                for i, load in zip(to, loads, strict=True)]

    @abstractmethod
    def _load(self, version: Any, to: list[int]) -> list[Any]:
        """Start loading learner 0's weights into engines `to`; one handle per engine, resolving to the version."""


@dataclass
class StreamedBuckets:
    """A push's buckets as the handles of every learner's `weight_pieces` calls (one list a bucket, `specs` its
    layout), handed to an engine's `load_weights`, which fetches each bucket's pieces only when its reload reaches
    it, as `BucketParts`.

    Ray resolves the ObjectRefs among a call's top-level arguments before the call runs, which would put every
    bucket, the whole model, in the engine's process at once; refs inside an argument travel as refs. So each
    bucket's pieces are fetched (`ray.get`, in the engine's process) when iteration reaches it, and dropped once
    loaded; the engine also starts loading while the learners are still casting later buckets. A local call's
    handle is already resolved (`Done`). The worker sees only an iterable of buckets: Ray stays in this layer."""

    handles: list[list[Any]]
    specs: list[Spec]

    def __iter__(self) -> Iterator[BucketParts]:
        for spec, handles in zip(self.specs, self.handles, strict=True):
            yield BucketParts(spec, [self._fetch(handle) for handle in handles])

    @staticmethod
    def _fetch(handle: Any) -> Any:
        if isinstance(handle, Done):
            if handle.error is not None:
                raise handle.error
            return handle.value
        import ray

        return ray.get(handle)


class ObjectStoreSync(WeightSync):
    def _load(self, version: Any, to: list[int]) -> list[Any]:
        if not to:  # every engine is being replaced: each loads the weights when it is ready
            return []
        # Each learner's pieces of a bucket are put in the object store once and read from shared memory by every
        # rollout actor on a node, one bucket at a time (StreamedBuckets).
        buckets = StreamedBuckets([self.learners.map(Learner.weight_pieces, spec, self.dtype) for spec in self.specs],
                                  self.specs)
        return [self.rollouts.call(i, RolloutWorker.load_weights, version, buckets) for i in to]


@dataclass
class Broadcast:
    """An NCCL broadcast in flight: learner 0's send and each engine's load (index -> handle), from `started`."""

    sent: Any
    loads: dict[int, Any]
    started: float


class NcclSync(WeightSync):
    """Learner 0 broadcasts each push to every worker of every engine over an NCCL world of its own: learner 0 is
    rank 0, the active engines' workers ranks 1, 2, ... in index order (an engine of tensor-parallel size k takes k
    consecutive ranks; each worker receives the whole bucket and its loaders keep its slice). One broadcast is in
    flight at a time: a push starts once the previous one has ended.

    A dead engine is replaced (`push_one`): every rank drops its communicator and the world forms again, on a
    fresh port, with the new engine in the dead one's place; learner 0 then broadcasts its current weights to every
    engine (a broadcast needs every rank: the others load them again). An engine added while the run goes on joins
    the same way, and one let go leaves the world, which forms again without it before the next broadcast. What
    cannot be recovered ends the run with an error saying so: an engine that dies while a broadcast waits for it
    (learner 0 would wait for ever, inside NCCL), or a second engine dead when the world forms again."""

    skips_engines = False  # a broadcast needs every rank: an unreachable engine is replaced at once

    def __init__(self, learners: ActorGroup[Learner], rollouts: ActorGroup[RolloutWorker], dtype: str,
                 bucket_bytes: int, timeout_s: float, verify: bool, workers_per_engine: int = 1):
        super().__init__(learners, rollouts, dtype, bucket_bytes, timeout_s, verify)
        self.workers_per_engine = workers_per_engine
        self._sent: Any = None  # the handle of the broadcast `_load` submitted last, until it is recorded
        self._last: Broadcast | None = None  # the newest broadcast started
        self.members: dict[int, int] = {}  # engine index -> its incarnation, for each engine in the world
        self.port = 0  # the rendezvous port of the world
        self._wait_ready(rollouts.active())
        self._form_world()
        say(f"weight sync: NCCL, learner 0 and {len(rollouts)} engines. A dead engine is replaced and joins a new "
              f"NCCL world (cluster.recovery.max_restarts), unless it dies while a broadcast waits for it: that ends "
              f"the run (continue from the newest checkpoint with --set run.resume=true)")

    def _wait_ready(self, engines: list[int]) -> None:
        """Wait until `engines` are constructed (each answers its version): the NCCL world's rendezvous waits
        only `timeout_s` for every rank, and an engine's `nccl_connect` runs only after its constructor (loading the
        model, compiling, capturing CUDA graphs: minutes for a large model), so learner 0 must not open it
        before."""
        self.backend.answer([self.rollouts.call(i, RolloutWorker.version) for i in engines],
                            f"the start-up of {', '.join(self.rollouts.name(i) for i in engines)} before the NCCL "
                            f"weight-sync group forms", self.timeout_s, "cluster.sync_timeout_s")

    def _dead_before_forming(self, engines: list[int]) -> dict[int, BaseException]:
        """Wait until `engines` are constructed, as `_wait_ready`; returns those found dead, with their error."""
        handles = {i: self.rollouts.call(i, RolloutWorker.version) for i in engines}
        dead: dict[int, BaseException] = {}
        deadline = time.perf_counter() + self.timeout_s
        for i, handle in handles.items():
            try:
                self.backend.answer(handle, f"the start-up of {self.rollouts.name(i)} before the NCCL weight-sync "
                                    f"group forms again", max(0.0, deadline - time.perf_counter()),
                                    "cluster.sync_timeout_s")
            except Exception as err:
                if not self.rollouts.lost(i, err):
                    raise
                dead[i] = err
        return dead

    def _current(self) -> dict[int, int]:
        """The world the engines need now: each active engine's index -> incarnation."""
        return {i: self.rollouts.incarnations[i] for i in self.rollouts.active()}

    def _form_world(self) -> None:
        """Learner 0 (rank 0) and every active engine's workers (ranks 1, 2, ... in index order, k a engine) make
        the NCCL world, rendezvous at a free port of learner 0's node, each waiting at most `timeout_s` for the
        others (vLLM's `store_timeout`); each drops the communicator of an earlier world."""
        host = self.learners.node_ip(0)
        self.port = self.backend.answer(self.learners.call(0, Learner.free_port, host), "learner 0's free port",
                                        self.timeout_s, "cluster.sync_timeout_s")
        self.members = self._current()
        k = self.workers_per_engine
        world = len(self.members) * k + 1
        self.backend.answer([self.learners.call(0, Learner.nccl_connect, host, self.port, world, self.timeout_s),
                             *[self.rollouts.call(i, RolloutWorker.nccl_connect, host, self.port, 1 + n * k, world,
                                                  self.timeout_s) for n, i in enumerate(self.members)]],
                            "the NCCL weight-sync group's connection (learner 0 and every engine)", self.timeout_s,
                            "cluster.sync_timeout_s")

    def push_one(self, index: int) -> Any:
        """Load learner 0's current weights into engine `index`, a replacement: once the broadcast in flight has
        ended and every engine, the new one too, answers, the world forms again with it (every rank, a fresh port), and
        learner 0 broadcasts its current weights to every engine. Returns the handle of engine `index`'s load,
        resolving to the version it then serves. The driver waits for the broadcast in flight, the new engine's
        start-up and the world's forming (not for the broadcast of the weights)."""
        self._end_broadcast()
        everyone = self.rollouts.active()
        if self.members != self._current():
            # Every rank must join: one found dead now would leave the others waiting in the rendezvous.
            dead = self._dead_before_forming(everyone)
            others = {i: err for i, err in dead.items() if i != index}
            if others:
                first = next(iter(others.values()))
                raise RuntimeError(f"weight sync (NCCL): {self.rollouts.name(index)} was to join a new NCCL world, "
                                   f"but {', '.join(self.rollouts.name(i) for i in others)} is dead too, and a world "
                                   f"needs every rank (two engines dead at once cannot be replaced under NCCL weight "
                                   f"sync; continue from the newest checkpoint with --set run.resume=true): {first}"
                                   ) from first
            if dead:  # the replacement died starting: its load fails with that death, and the producer replaces it
                return self.rollouts.call(index, RolloutWorker.version)
            self._form_world()
            say(f"weight sync: {self.rollouts.name(index)} joined a new NCCL world (port {self.port}) with learner "
                  f"0 and the other engines")
        loads = self._transfer(self.learners.call(0, Learner.weights_version), everyone)
        self._last = Broadcast(self._sent, dict(zip(everyone, loads, strict=True)), time.perf_counter())
        return loads[index]

    def start(self, version: int, skip: set[int] | frozenset[int] = frozenset()) -> PendingSync:
        """Submit learner 0's broadcast and every engine's receive, and return at once (as over the object store:
        the driver goes on while the engines finish their chunks and take the weights); `finish` watches the
        broadcast. It goes to every engine, `skip` too: a replacement is in the world once `push_one` returned, and
        a broadcast needs every rank. (It first waits for a broadcast of `push_one` still in flight.)"""
        self._end_broadcast()
        pending = super().start(version)
        pending.broadcast = self._sent
        self._last = Broadcast(self._sent, pending.handles, pending.started)
        return pending

    def finish(self, pending: PendingSync) -> SyncStats:
        """Wait for learner 0's broadcast, failing fast (`_broadcast_done`), then for every engine's load."""
        if pending.broadcast is not None:
            self._broadcast_done(Broadcast(pending.broadcast, pending.handles, pending.started))
        return super().finish(pending)

    def _end_broadcast(self) -> None:
        """Wait for the newest broadcast to end (`_broadcast_done`): a world changes, and a broadcast starts, only
        then."""
        if self._last is not None:
            self._broadcast_done(self._last)
            self._last = None

    def _load(self, version: Any, to: list[int]) -> list[Any]:
        if self.members.keys() - self._current().keys():  # an engine was let go: the world forms again without it
            self._form_world()
        assert to == list(self.members), "an NCCL push goes to every engine of the world: a broadcast needs every rank"
        self._sent = self.learners.map(Learner.nccl_send, self.specs, self.dtype)[0]
        return [self.rollouts.call(i, RolloutWorker.nccl_receive, version, self.specs, self.dtype) for i in to]

    def _broadcast_done(self, broadcast: Broadcast) -> None:
        """Wait for learner 0's send of `broadcast`, watching the engines' loads: one that fails (a dead engine
        leaves the broadcast waiting for ever) or a broadcast not done `timeout_s` after it started ends the run,
        naming who did not finish."""
        sent, deadline = broadcast.sent, broadcast.started + self.timeout_s
        waiting = {sent: "learner 0's broadcast", **{h: self.rollouts.name(i) for i, h in broadcast.loads.items()}}
        while sent in waiting:
            done, _ = self.backend.wait(list(waiting), timeout=max(0.0, deadline - time.perf_counter()))
            if not done:
                raise RuntimeError(f"weight sync (NCCL): not finished within cluster.sync_timeout_s = "
                                   f"{self.timeout_s:g} s: {', '.join(waiting.values())}")
            if sent in done:  # the broadcast is over: an engine that failed after it is `finish`'s (a lost engine)
                done = [sent]
            for handle in done:
                who = waiting.pop(handle)
                try:
                    self.backend.get(handle)
                except Exception as err:
                    raise RuntimeError(f"weight sync (NCCL): {who} failed during a broadcast, which cannot go on "
                                       f"without it (an engine that dies while a broadcast waits for it cannot be "
                                       f"replaced: learner 0 waits inside NCCL; continue from the newest "
                                       f"checkpoint with --set run.resume=true): {err}") from err


def make_weight_sync(kind: str, learners, rollouts, dtype: str, bucket_bytes: int, gpus: bool,
                     timeout_s: float, verify: bool, workers_per_engine: int = 1) -> WeightSync:
    """`kind` is cluster.weight_sync: auto picks NCCL when both roles have GPUs, in Ray actors (the local
    backend's roles share one process, hence one GPU)."""
    if kind == "nccl" or (kind == "auto" and gpus and isinstance(learners, RayGroup)):
        return NcclSync(learners, rollouts, dtype, bucket_bytes, timeout_s, verify, workers_per_engine)
    return ObjectStoreSync(learners, rollouts, dtype, bucket_bytes, timeout_s, verify)
