"""Keeping the rollout engines alive, and as many of them as their bounds and the cluster allow; the producer
(`distrl.cluster.producer`) feeds whichever serve.

- **A death.** An engine that dies (its process killed, its node lost; noticed when its chunk or a weight push to
  it fails) is replaced on its placement bundle, and `load_weights(i)` loads the learners' current weights into the
  new one before it serves (again, if a push it was left out of made them newer meanwhile). At most
  `recovery.max_restarts` replacements of one engine within `recovery.window_s`; one more death ends the run with
  the engine's last error. A replacement that does not serve within `recovery.start_timeout_s` ends the run naming
  the engine and where it may run (its placement may wait for a node that never comes back). An engine that Ray
  cannot reach (its node lost, which Ray declares only once the node's health checks have failed) is replaced once
  Ray declares it dead, at once if it answers again (it missed pushes), or after `recovery.verdict_timeout_s`: a
  replacement sent to its bundle before then would be sent to the lost node and die with it, a second death for
  one loss. Where pushes cannot leave an engine out
  (the NCCL weight sync: a broadcast needs every rank), it is replaced at once.
- **Fewer engines.** While more than `cluster.rollout.min_actors` engines serve, a dead one is let go instead
  (its resources given back) and the others take its prompts.
- **More engines.** While fewer than `cluster.rollout.max_actors` serve or start, one more waits for room: a
  placement group of one engine's resources, on the nodes the role may use. When Ray places it (a node with room
  joined, or had room already) the engine starts there, loads the current weights and then serves.

Staleness is not this module's business: an engine serves only once it holds weights at least as new as the
newest push (`done` checks), and the producer admits prompts by batches of room, whatever the number of engines.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from distrl.cluster.capacity import where
from distrl.cluster.deadlines import Deadlines
from distrl.cluster.group import ActorGroup
from distrl.config import RecoveryConfig
from distrl.console import say
from distrl.workers.rollout.worker import RolloutWorker

VERDICT_POLL_S = 1.0
"""How often an engine Ray cannot reach is asked about (whether Ray has declared it dead)."""


@dataclass
class EngineCounts:
    """What happened to the engines since the counts were last taken."""

    restarts: int = 0  # engines replaced after a death
    retired: int = 0  # engines let go after a death (above min_actors)
    added: int = 0  # engines started while the run went on (below max_actors)


class Engines:
    """The lifecycle of the rollout engines of `actors`. `load_weights(i)` loads the learners' current weights into
    engine i and returns a handle resolving to the version it then serves (None: engines cannot be replaced,
    `unreplaceable` says why). `deadlines` are the producer's, where replacements get theirs. `fewest`, `most`: the
    bounds of the number of engines. `pushes_skip`: weight pushes can leave an engine out (not under NCCL)."""

    def __init__(self, actors: ActorGroup[RolloutWorker], *, load_weights: Callable[[int], Any] | None,
                 unreplaceable: str, recovery: RecoveryConfig, deadlines: Deadlines,
                 fewest: int | None = None, most: int | None = None, pushes_skip: bool = True):
        self.actors, self.load_weights, self.unreplaceable = actors, load_weights, unreplaceable
        self.recovery, self.deadlines = recovery, deadlines
        self.fewest, self.most = fewest or len(actors), most or len(actors)
        # weight-load handle -> (engine, its incarnation, when it was replaced or started)
        self.loading: dict[Any, tuple[int, int, float]] = {}
        self.growing: Any = None  # the handle of the placement reserved for one more engine, until Ray places it
        self._deaths: dict[int, deque[float]] = {}
        # engine -> (its error, when): unreachable, replaced once Ray declares it dead (`poll`)
        self.unsure: dict[int, tuple[BaseException, float]] = {}
        self.pushes_skip = pushes_skip
        self._asked = 0.0  # when `poll` last asked Ray about the unreachable engines
        self.counts = EngineCounts()
        self._grow()

    def handles(self) -> list[Any]:
        """What the producer waits for on the engines' behalf."""
        return [*self.loading, *self.waiting_for_room()]

    def waiting_for_room(self) -> list[Any]:
        """The handle of the room reserved for one more engine, while Ray has not placed it: it may never be."""
        return [self.growing] if self.growing is not None else []

    def __contains__(self, handle: Any) -> bool:
        return handle in self.loading or (self.growing is not None and handle is self.growing)

    def starting(self) -> set[int]:
        """Engines loading their first weights, and unreachable ones about to be replaced: pushes leave them out
        (the new ones load the weights when they are ready)."""
        return {engine for engine, _, _ in self.loading.values()} | set(self.unsure)

    def pop_counts(self) -> EngineCounts:
        counts, self.counts = self.counts, EngineCounts()
        return counts

    def lost(self, engine: int, incarnation: int, error: BaseException) -> bool:
        """Engine `engine`, as it was at `incarnation`, is gone (`error`): let it go, or replace it, unless that was
        done already (a chunk and a weight push can both report the same death). Returns whether it was done now.

        An engine Ray cannot reach (its node may be lost, not yet declared) at `min_actors`, where pushes may leave
        it out, waits for Ray's word (`poll`): a replacement sent to its placement bundle before Ray declares it dead
        would be sent to the lost node and die with it. Otherwise it is let go or replaced at once. A death reported
        for an engine that waits (its actor declared dead) is that word."""
        if incarnation != self.actors.incarnations[engine] or engine in self.actors.retired:
            return False
        if engine in self.unsure:
            if self.actors.backend.unreachable(error):
                return False  # the same loss, reported again
            del self.unsure[engine]
            self._let_go_or_replace(engine, error)
            return True
        name = self.actors.name(engine)
        if self.load_weights is None:
            raise RuntimeError(f"rollout actor {name} died, and it cannot be replaced alone: {self.unreplaceable}. "
                               f"Its error: {error}") from error
        for handle, (e, _, _) in list(self.loading.items()):  # a replacement that died starting
            if e == engine:
                del self.loading[handle]
                self.deadlines.pop(handle)
        if self.pushes_skip and len(self.actors.active()) <= self.fewest and self.actors.backend.unreachable(error):
            self.unsure[engine] = (error, time.monotonic())
            say(f"rollout actor {name} cannot be reached ({type(error).__name__}): replacing it once Ray declares "
                  f"it dead (its node lost?), within cluster.recovery.verdict_timeout_s = "
                  f"{self.recovery.verdict_timeout_s:g} s")
        else:
            self._let_go_or_replace(engine, error)
        return True

    def poll(self) -> list[int]:
        """Deal with the unreachable engines Ray has declared dead since, that answer again, or that stayed
        unreachable `recovery.verdict_timeout_s` (Ray is asked at most every `VERDICT_POLL_S`): let go if an engine
        joined meanwhile, else replaced. One that answers again is replaced too, at once, on its node, which is
        alive: it missed the pushes made while it could not be reached. Returns the engines let go."""
        now = time.monotonic()
        if not self.unsure or now - self._asked < VERDICT_POLL_S:
            return []
        self._asked = now
        retired = []
        for engine, (error, since) in list(self.unsure.items()):
            timed_out = now - since > self.recovery.verdict_timeout_s
            verdict = None if timed_out else self.actors.verdict(engine)
            if verdict is None and not timed_out:
                continue
            if verdict is False:
                say(f"rollout actor {self.actors.name(engine)} answers again, but missed the weight pushes made "
                      f"while it could not be reached")
            del self.unsure[engine]
            self._let_go_or_replace(engine, error)
            if engine in self.actors.retired:
                retired.append(engine)
        return retired

    def _let_go_or_replace(self, engine: int, error: BaseException) -> None:
        """Above `min_actors` let the dead `engine` go (its resources given back); at it, replace it."""
        if len(self.actors.active()) > self.fewest:
            name = self.actors.name(engine)
            self.actors.retire(engine)
            self.counts.retired += 1
            say(f"rollout actor {name} died ({type(error).__name__}); letting it go, engines left: "
                  f"{len(self.actors.active())} (cluster.rollout.min_actors = {self.fewest})")
            self._grow()
        else:
            self._replace(engine, error)

    def _replace(self, engine: int, error: BaseException) -> None:
        """Start a replacement of `engine` on its placement bundle, within the restart budget."""
        name, r = self.actors.name(engine), self.recovery
        now = time.monotonic()
        deaths = self._deaths.setdefault(engine, deque())
        deaths.append(now)
        while deaths[0] < now - r.window_s:
            deaths.popleft()
        if len(deaths) > r.max_restarts:
            budget = ("cluster.recovery.max_restarts is 0: a dead rollout actor ends the run" if not r.max_restarts
                      else f"it died {len(deaths)} times within cluster.recovery.window_s = {r.window_s:g} s, "
                           f"more than cluster.recovery.max_restarts = {r.max_restarts}")
            raise RuntimeError(f"rollout actor {name} died; {budget}. Its last error: {error}") from error
        say(f"rollout actor {name} died ({type(error).__name__}); starting a replacement on its placement bundle "
              f"(restart {len(deaths)} of {r.max_restarts} allowed within {r.window_s:g} s)")
        if self.growing is not None and self.actors.placement is not None:
            # At min_actors the replacement comes first: room reserved for one more engine could take the node
            # it waits for. Reserved again once the replacement serves.
            self.actors.placement.withdraw()
            self.growing = None
        self.actors.restart(engine)
        self._load(engine, self.actors.incarnations[engine], time.perf_counter(), "replaced")
        self.counts.restarts += 1

    def done(self, handle: Any, version: int) -> list[int]:
        """`handle` (one of `handles()`) is done; `version` is the newest pushed. Returns the engines that now
        serve."""
        if self.growing is not None and handle is self.growing:
            self.growing = None
            engine = self.actors.add()  # on the placement group Ray has just placed
            self.counts.added += 1
            say(f"rollout actor {self.actors.name(engine)} starts: a node has room for one more engine "
                  f"({len(self.actors.active())} of at most cluster.rollout.max_actors = {self.most})")
            self._load(engine, 0, time.perf_counter(), "started")
            return []
        engine, incarnation, since = self.loading.pop(handle)
        try:
            served = self.actors.backend.get(handle)
        except Exception as err:
            if not self.actors.lost(engine, err):  # its own death is recovered; learner 0's is not the engine's
                raise
            self.lost(engine, incarnation, err)
            return []
        if served < version:  # a push went out while it started, without it: load the newer weights
            self._load(engine, incarnation, since, "started")
            return []
        say(f"rollout actor {self.actors.name(engine)} serves policy version {served}, "
              f"{time.perf_counter() - since:.1f} s after it was started")
        self._grow()
        return [engine]

    def _load(self, engine: int, incarnation: int, since: float, how: str) -> None:
        """Load the current weights into `engine` (started at `since`); it must serve within `start_timeout_s`."""
        assert self.load_weights is not None
        handle = self.load_weights(engine)
        self.loading[handle] = (engine, incarnation, since)
        limit = self.recovery.start_timeout_s
        placement = self.actors.placement
        needs = f" {where(placement.resources)}" if placement is not None else ""
        self.deadlines.set(handle, since + limit, f"rollout actor {self.actors.name(engine)} does not serve within "
                           f"cluster.recovery.start_timeout_s = {limit:g} s of being {how}: its placement bundle may "
                           f"have no node to run on{needs} (a node lost and no other with room), or its engine hangs "
                           f"while starting")

    def _grow(self) -> None:
        """Reserve room for one more engine if the bounds allow one and none is waiting for room already."""
        if self.growing is not None or self.actors.placement is None or self.load_weights is None:
            return
        if len(self.actors.active()) < self.most:
            engine, self.growing = self.actors.placement.add()
            assert engine == len(self.actors), "a placement slot per engine, in order"
