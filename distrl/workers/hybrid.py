"""Hybrid worker: a learner that also hosts a vLLM engine and, with a KL term, the reference model, in one process
on one device (`cluster.colocate: hybrid`). Plain class, no Ray.

The parts are the plain workers themselves (`Learner`, `RolloutWorker`, `ReferenceWorker`). The driver addresses each
as if it were an actor of its own role: `distrl.cluster.hybrid.RoleView` turns `group.call(i, Learner.update, b)`
into `HybridWorker.run("learner", "update", b)`, so the loops, the producer and the weight sync's checks run
unchanged. The parts take turns: a hybrid actor runs one call at a time, in the order the driver sent them.

Weights pass in memory (`push`): the learner's tensors, cast to the rollout dtype on the learner's device, go to the
engine's in-place reload bucket by bucket, with no serialisation and no object store (with the replicate strategy
and the same dtype the engine reads the learner's own tensors; FSDP gathers each bucket on every learner, since
each has an engine of its own).

On a GPU the parts also take turns for memory (`DeviceTurns`): the engine sleeps while the learner and the reference
score and train (level 1: weights to CPU memory, KV cache released; level 2: weights discarded, since the next push
loads them anyway), and the optimizer state leaves the device while the engine generates. vLLM's CPU build has no
sleep mode: on CPU every part stays in memory, and the turns change nothing.

The parts compute on two threads, the actor's (learner, reference) and the engine's, and those take turns too
(`ThreadTurns`): the OpenMP threads of the one whose turn is over end, else the two pools slow each other down.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from distrl.config import HybridConfig
from distrl.workers import openmp
from distrl.workers.rollout.engine_loop import EngineLoop
from distrl.workers.rollout.worker import RolloutWorker
from distrl.workers.training import dist
from distrl.workers.training.learner import Learner
from distrl.workers.training.reference import ReferenceWorker
from distrl.workers.training.token_budget import ADAMW_BYTES, trained_parameters
from distrl.workers.weights import export
from distrl.workers.weights.pieces import BucketParts

ENGINE_CALLS = {("rollout", "generate"), ("rollout", "score"), ("rollout", "check_weights")}
"""Calls that run the engine: it must be awake, with its KV cache, and the optimizer's state may leave the device."""
TRAINING_CALLS = {("learner", "update"), ("learner", "save_checkpoint"), ("learner", "load_checkpoint")}
"""Calls that need the optimizer's state on the device (and the engine asleep)."""
SCORING_CALLS = {("learner", "logprobs"), ("learner", "ref_logprobs"), ("reference", "logprobs")}
"""Calls that run a forward pass of the learner or the reference: the engine sleeps."""
READING_CALLS = {("learner", "weights_fingerprint")}
"""Calls that read the learner's weights on the actor's thread and leave the device as it is: a push's check comes
between the push and the engine's own read, and sleeping the engine there would discard (level 2) or move (level 1)
the weights just pushed."""
ACTOR_THREAD, ENGINE_THREAD = "actor", "engine"
"""The threads a hybrid actor computes on: the actor's (learner, reference) and the engine's (vLLM, pushes)."""


class DeviceTurns:
    """Who holds the device's memory: the engine (awake: weights and KV cache) or the learner (engine asleep,
    optimizer state on the device). Every transition is idempotent; on CPU (`enabled` False) there are none.

    `sleep_level` 2 discards the engine's weights: `discarded` says so until a push loads them again, and a call
    that needs the engine meanwhile gets them from the learner first (`restore`)."""

    def __init__(self, engine: RolloutWorker, optimizer: Callable[[], torch.optim.Optimizer | None], device: str,
                 sleep_level: int, offload_optimizer: bool, enabled: bool):
        self.engine, self.optimizer, self.device = engine, optimizer, device
        self.sleep_level, self.offload, self.enabled = sleep_level, offload_optimizer, enabled
        self.weights_held = self.cache_held = True  # what of the engine's memory is on the device
        self.discarded = False  # a level-2 sleep dropped the weights, and no push has loaded them since
        self.offloaded = False  # the optimizer's state is in CPU memory

    def engine_turn(self, restore: Callable[[], object]) -> None:
        """The engine generates, scores or is checked: optimizer state out, engine awake (weights first: `restore`
        loads them if a level-2 sleep discarded them), then its KV cache."""
        if not self.enabled:
            return
        if self.offload and not self.offloaded:
            self._move_optimizer("cpu")
            self.offloaded = True
        self.weights_turn()
        if self.discarded:
            self.discarded = False
            restore()
        if not self.cache_held:
            self.engine.wake_up(tags=["kv_cache"])
            self.cache_held = True

    def weights_turn(self) -> None:
        """The engine's weights must be on the device (a push loads into them); its KV cache may stay released."""
        if self.enabled and not self.weights_held:
            self.engine.wake_up(tags=["weights"])
            self.weights_held = True

    def loaded(self) -> None:
        """A push wrote every weight: whatever a level-2 sleep discarded is back."""
        self.discarded = False

    def learner_turn(self, training: bool) -> None:
        """The learner (or the reference) computes: the engine sleeps; `training` brings the optimizer back."""
        if not self.enabled:
            return
        if self.weights_held or self.cache_held:
            self.engine.sleep(level=self.sleep_level)
            self.weights_held = self.cache_held = False
            self.discarded = self.discarded or self.sleep_level == 2
            torch.cuda.empty_cache()
        if training and self.offloaded:
            self._move_optimizer(self.device)
            self.offloaded = False

    def _move_optimizer(self, device: str) -> None:
        optimizer = self.optimizer()
        if optimizer is not None:
            move_optimizer_state(optimizer, device)


class ThreadTurns:
    """Which of the two threads computes next: before its turn, the other one's OpenMP threads end, so that one
    pool is alive and runs at full speed (why: `distrl.workers.openmp`). Only a change of thread costs anything: the
    pool's threads end, and the next parallel region starts them again."""

    def __init__(self, engine_loop: EngineLoop):
        self.engine_loop = engine_loop
        self.computing: str | None = None  # both threads may hold OpenMP threads until the first turn

    def turn(self, thread: str) -> None:
        """The next call computes on `thread` (ACTOR_THREAD, the caller's, or ENGINE_THREAD)."""
        if thread == self.computing:
            return
        if thread == ACTOR_THREAD:
            self.engine_loop.call(openmp.release_threads)
        else:
            openmp.release_threads()
        self.computing = thread


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: str) -> None:
    """Move `optimizer`'s state tensors to `device` (to CPU memory: pinned when there is a GPU, so that the way back
    is an asynchronous copy), and release what they held."""
    pin = device == "cpu" and torch.cuda.is_available()
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:  # AdamW's step counts stay where they are
                moved = value.to(device, non_blocking=True)
                state[key] = moved.pin_memory() if pin else moved
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies are done before the engine or the update uses the memory
        torch.cuda.empty_cache()


def optimizer_of(learner: Learner) -> torch.optim.Optimizer | None:
    trainer = getattr(learner, "trainer", None)  # a sharded learner builds it once its group is joined
    return None if trainer is None else trainer.optimizer


class HybridWorker:
    """A learner with its own engine (and reference): `run(part, method, ...)` calls `method` of part `part`
    ("learner", "rollout", "reference") in its turn; `push(version, ...)` loads the learner's weights into the
    engine."""

    def __init__(self, learner: tuple[tuple, dict], rollout: tuple[tuple, dict],
                 reference: tuple[tuple, dict] | None, cfg: HybridConfig, *, dtype: str, bucket_bytes: int,
                 full_pushes: bool, sync_loop: bool, grouped: bool):
        self.learner = Learner(*learner[0], **learner[1], share_device=True)
        self.parts: dict[str, Any] = {"learner": self.learner}
        if reference is not None:
            self.parts["reference"] = ReferenceWorker(*reference[0], **{**reference[1], "share_device": True})
        self.dtype, self.bucket_bytes = dtype, bucket_bytes
        self._specs: list[export.Spec] | None = None  # the push's bucket layout, once the model is built
        # Level 2 discards the engine's weights: safe when a push reloads them all before the engine next runs,
        # which the synchronous loop does after every update (a call that comes first restores them anyway).
        self._sleep = (cfg.sleep_level or (2 if full_pushes and sync_loop else 1), cfg.offload_optimizer)
        self._rollout_init = rollout
        # In a process group (`grouped`: Ray actors, which `connect` joins) the engine is built once it is joined.
        if not grouped:
            self._start_engine()

    def _start_engine(self) -> None:
        """Build the engine (after the learner: on a GPU it takes its budget, gpu_memory_utilization, of the memory
        the learner leaves) and put it to sleep until its first turn."""
        args, kwargs = self._rollout_init
        self.rollout = self.parts["rollout"] = RolloutWorker(
            *args, **{**kwargs, "in_process_group": torch.distributed.is_initialized()})
        level, offload = self._sleep
        # The learner's optimizer, not a method of this worker: a cycle would keep the worker, and its engine's
        # thread, until a collection.
        self.turns = DeviceTurns(self.rollout, functools.partial(optimizer_of, self.learner), self.learner.device,
                                 level, offload,
                                 enabled=self.rollout.on_gpu)
        self.turns.learner_turn(training=False)
        self.threads = ThreadTurns(self.rollout.engine)
        self.resolve_token_budgets()

    def resolve_token_budgets(self) -> None:
        """The learner's and the reference's `auto` token budgets, once every part is built and the engine asleep
        (as it is whenever they compute), from the memory then free: the learner's beside the reference's weights
        and the engine's sleeping remainder; the reference's also less the learner's AdamW moments, made at its
        first step and on the device while the reference scores unless they leave it while the engine generates
        (`cluster.hybrid.offload_optimizer`)."""
        trainer = self.learner.trainer
        trainer.resolve_token_budget()
        reference = self.parts.get("reference")
        if reference is not None:
            offloaded = self.turns.enabled and self.turns.offload
            reference.resolve_token_budget(0 if offloaded else ADAMW_BYTES * trained_parameters(trainer.model))

    def connect(self, master_addr: str, master_port: int, rank: int, world_size: int,
                timeout_s: float = dist.default_pg_timeout.total_seconds()) -> str:
        """`Learner.connect`, then the engine: every hybrid actor builds it at once (its groups are collectives)."""
        backend = self.learner.connect(master_addr, master_port, rank, world_size, timeout_s)
        self._start_engine()
        return backend

    def run(self, part: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """`method(*args, **kwargs)` of part `part`, once the device is that part's."""
        if (part, method) == ("learner", "connect"):
            return self.connect(*args, **kwargs)
        if (part, method) in ENGINE_CALLS:
            self.threads.turn(ENGINE_THREAD)
            self.turns.engine_turn(restore=lambda: self._load(self.learner.weights_version()))
        elif (part, method) in TRAINING_CALLS or (part, method) in SCORING_CALLS:
            self.threads.turn(ACTOR_THREAD)
            self.turns.learner_turn(training=(part, method) in TRAINING_CALLS)
        elif (part, method) in READING_CALLS:
            self.threads.turn(ACTOR_THREAD)
        if part not in self.parts:
            raise ValueError(f"this hybrid actor has no {part} (it has {', '.join(self.parts)})")
        return getattr(self.parts[part], method)(*args, **kwargs)

    def push(self, version: int) -> int:
        """Load the learner's weights, as of `version` (its count of updates), into the engine; returns the version
        the engine then serves. With a sharded learner every hybrid actor takes part (each bucket is gathered on
        every learner)."""
        if version != self.learner.weights_version():
            raise RuntimeError(f"a push of version {version} to an engine whose learner holds version "
                               f"{self.learner.weights_version()}")
        self.threads.turn(ENGINE_THREAD)  # the buckets are made on the engine's thread, as its reload asks for them
        self.turns.weights_turn()
        served = self._load(version)
        self.turns.loaded()
        return served

    def _load(self, version: int) -> int:
        if self._specs is None:
            self._specs = self.learner.weight_specs(self.bucket_bytes, self.dtype)
        return self.rollout.load_weights(version, self._buckets(self._specs))

    def _buckets(self, specs: list[export.Spec]) -> Iterator[BucketParts]:
        for spec in specs:  # made when the engine's reload asks for it: one bucket at a time
            yield BucketParts.whole(self.learner.local_bucket(spec, self.dtype))
