"""Hybrid mode (`cluster.colocate: hybrid`): the config's rules, the turns the device takes between the engine and the
learner (with fakes: the CPU build has no sleep mode), the role views' routing, and a run on the local backend that
equals the same run with every role apart, row for row (real vLLM and transformers, in this process)."""

import threading
from pathlib import Path

import pytest
import test_learner
import torch

from distrl import config
from distrl.cluster.backend import LocalBackend
from distrl.cluster.group import LocalGroup
from distrl.cluster.hybrid import RoleView
from distrl.cluster.roles import role_threads
from distrl.workers import hybrid
from distrl.workers.hybrid import ACTOR_THREAD, ENGINE_THREAD, DeviceTurns, ThreadTurns
from distrl.workers.rollout.engine_loop import EngineLoop
from distrl.workers.rollout.worker import RolloutWorker
from distrl.workers.training.learner import Learner
from distrl.workers.training.reference import ReferenceWorker
from distrl.workers.weights.pieces import BucketParts, Pieces, assemble

ROOT = Path(__file__).resolve().parents[1]


def quickstart(*overrides: str) -> config.Config:
    return config.load(ROOT / "configs" / "quickstart.yaml", ["eval=null", *overrides])


# ------------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("value,read", [("true", "pack"), ("false", "none"), ("hybrid", "hybrid"), ("pack", "pack")])
def test_colocate_reads_the_old_switch_and_the_modes(value, read):
    assert quickstart(f"cluster.colocate={value}").cluster.colocate == read


def test_hybrid_refuses_a_transport_of_its_own():
    with pytest.raises(config.ConfigError, match=r"weight_sync 'object_store' with cluster\.colocate 'hybrid'"):
        quickstart("cluster.colocate=hybrid", "cluster.weight_sync=object_store")


def test_the_asynchronous_hybrid_loop_is_one_step_off_at_most():
    assert quickstart("cluster.colocate=hybrid", "loop.mode=async", "loop.max_staleness=1").max_staleness == 1
    with pytest.raises(config.ConfigError, match=r"its asynchronous loop is one step off \(loop.max_staleness 1\)"):
        quickstart("cluster.colocate=hybrid", "loop.mode=async", "loop.max_staleness=2")


def test_a_hybrid_engine_serves_one_chunk_at_a_time():
    """A hybrid actor runs one call at a time: a second chunk would wait for the first, not share the engine."""
    env = ["env.class=tests.agent_envs:Chatter", "env.max_turns=2"]
    assert quickstart(*env).chunks_per_engine == 4
    assert quickstart("cluster.colocate=hybrid", *env).chunks_per_engine == 1
    with pytest.raises(config.ConfigError, match=r"rollout.chunks_per_engine 2 with cluster.colocate 'hybrid': a "
                                                 r"hybrid actor runs one call at a time"):
        quickstart("cluster.colocate=hybrid", "rollout.chunks_per_engine=2")


def test_hybrid_runs_one_engine_per_learner_whatever_the_rollout_section_says():
    cfg = quickstart("cluster.colocate=hybrid", "cluster.learner.num_actors=2", "learner.micro_batch_size=16")
    assert cfg.cluster.hybrid_mode and cfg.cluster.rollout.num_actors == 1  # not used: the learners host the engines
    assert cfg.engines == 2 and quickstart("cluster.learner.num_actors=2", "learner.micro_batch_size=16").engines == 1


def test_hybrid_actors_reserve_only_the_learners_resources():
    # Apart, the quickstart's roles reserve 0.5 + 0.5 + 0.25 CPUs (and a reward task 0.05); hybrid, 0.5 + 0.05.
    cfg = quickstart("cluster.colocate=hybrid", "cluster.rollout.num_cpus=2", "cluster.reference.num_cpus=2")
    assert cfg.unplaceable(0.6, "cluster.num_cpus", "num_cpus") is None
    assert quickstart().unplaceable(0.6, "cluster.num_cpus", "num_cpus") is not None


def test_a_hybrid_actor_takes_every_core_in_either_loop(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for loop in ("sync", "async"):
        cfg = quickstart("cluster.colocate=hybrid", f"loop.mode={loop}", "cluster.num_cpus=2")
        assert role_threads("learner", cfg) == 2
    two = quickstart("cluster.colocate=hybrid", "cluster.num_cpus=2", "cluster.learner.num_actors=2",
                     "cluster.rollout.num_actors=2", "learner.micro_batch_size=16")
    assert role_threads("learner", two) == 1


# ------------------------------------------------------------------------------------------------ device turns
class FakeEngine:
    def __init__(self):
        self.calls: list[tuple] = []

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", *tags))


def adam_on(device: str) -> torch.optim.Optimizer:
    p = torch.nn.Parameter(torch.ones(3, device=device))
    optimizer = torch.optim.AdamW([p])
    p.grad = torch.ones(3, device=device)
    optimizer.step()
    return optimizer


@pytest.fixture
def no_cuda_sync(monkeypatch):
    """The turns synchronise and empty CUDA's cache: stand-ins on this CPU-only machine."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_the_engine_sleeps_for_the_learner_and_wakes_weights_first(no_cuda_sync):
    engine, restored = FakeEngine(), []
    turns = DeviceTurns(engine, lambda: None, "cpu", sleep_level=1, offload_optimizer=False, enabled=True)
    turns.learner_turn(training=False)
    turns.learner_turn(training=True)  # already asleep: nothing more
    turns.engine_turn(restore=lambda: restored.append(1))
    turns.engine_turn(restore=lambda: restored.append(1))  # awake: nothing
    assert engine.calls == [("sleep", 1), ("wake_up", "weights"), ("wake_up", "kv_cache")]
    assert restored == []  # level 1 kept the weights


def test_level_two_weights_come_back_from_a_push_or_else_from_the_learner(no_cuda_sync):
    engine, restored = FakeEngine(), []
    turns = DeviceTurns(engine, lambda: None, "cpu", sleep_level=2, offload_optimizer=False, enabled=True)
    turns.learner_turn(training=True)
    turns.weights_turn()  # a push: it writes every weight
    turns.loaded()
    turns.engine_turn(restore=lambda: restored.append(1))
    assert engine.calls == [("sleep", 2), ("wake_up", "weights"), ("wake_up", "kv_cache")]
    assert restored == []
    turns.learner_turn(training=True)
    turns.engine_turn(restore=lambda: restored.append(1))  # no push since the sleep: the learner's weights
    assert restored == [1]
    assert engine.calls[-3:] == [("sleep", 2), ("wake_up", "weights"), ("wake_up", "kv_cache")]


def test_the_optimizer_state_leaves_the_device_while_the_engine_generates(no_cuda_sync, monkeypatch):
    moves: list[str] = []
    monkeypatch.setattr(hybrid, "move_optimizer_state", lambda optimizer, device: moves.append(device))
    turns = DeviceTurns(FakeEngine(), lambda: adam_on("cpu"), "cuda", sleep_level=1, offload_optimizer=True,
                        enabled=True)
    turns.engine_turn(restore=lambda: None)
    turns.engine_turn(restore=lambda: None)
    turns.learner_turn(training=False)  # scoring needs no optimizer
    assert moves == ["cpu"]
    turns.learner_turn(training=True)
    turns.learner_turn(training=True)
    assert moves == ["cpu", "cuda"]


def test_moving_the_optimizer_state_keeps_it_and_its_step_counts():
    optimizer = adam_on("cpu")
    before = {k: v.clone() for k, v in next(iter(optimizer.state.values())).items()}
    hybrid.move_optimizer_state(optimizer, "cpu")
    after = next(iter(optimizer.state.values()))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_on_the_cpu_build_the_turns_change_nothing():
    engine, optimizer = FakeEngine(), adam_on("cpu")
    turns = DeviceTurns(engine, lambda: optimizer, "cpu", sleep_level=2, offload_optimizer=True, enabled=False)
    turns.learner_turn(training=True)
    turns.weights_turn()
    turns.loaded()
    turns.engine_turn(restore=lambda: pytest.fail("nothing to restore"))
    assert engine.calls == []


# ------------------------------------------------------------------------------------------------ thread turns
def test_a_change_of_thread_ends_the_other_threads_openmp_threads(monkeypatch):
    released: list[str] = []  # the threads release_threads was called on
    monkeypatch.setattr(hybrid.openmp, "release_threads", lambda: released.append(threading.current_thread().name))
    loop = EngineLoop(lambda: None)
    try:
        turns = ThreadTurns(loop)
        for thread in (ENGINE_THREAD, ENGINE_THREAD, ACTOR_THREAD, ACTOR_THREAD, ACTOR_THREAD, ENGINE_THREAD):
            turns.turn(thread)
    finally:
        loop.stop(wait_s=5)
    caller = threading.current_thread().name
    assert released == [caller, "distrl-engine", caller]  # once per change, on the thread whose turn is over


class FakeParts(FakeEngine):
    """A hybrid actor's learner and engine in one fake: what reaches the engine, in order."""

    def update(self) -> None:
        pass

    def weights_version(self) -> int:
        return 1

    def weight_specs(self, bucket_bytes: int, dtype: str) -> list:
        return ["bucket"]

    def local_bucket(self, spec, dtype: str) -> dict:
        return {"w": torch.ones(1)}

    def load_weights(self, version: int, buckets) -> int:
        self.calls.append(("load", version, len(list(buckets))))
        return version

    def weights_fingerprint(self, dtype: str) -> dict:
        self.calls.append(("fingerprint",))
        return {"w": 1.0}

    def check_weights(self, load: int, name: str, *expected: dict) -> int:
        self.calls.append(("check", load))
        return load


class NoThreads:
    def turn(self, thread: str) -> None:
        pass


@pytest.mark.parametrize("level", [1, 2])
def test_a_push_is_checked_with_the_engine_awake(no_cuda_sync, level):
    """The push, learner 0's fingerprint, the engine's check: the fingerprint reads the learner's weights and must
    not put the engine to sleep between the push and the check (level 2 would discard the weights just pushed and
    load them a second time; level 1 would move them to CPU memory and back)."""
    parts = FakeParts()
    worker = object.__new__(hybrid.HybridWorker)
    worker.learner = worker.rollout = parts
    worker.parts = {"learner": parts, "rollout": parts}
    worker.dtype, worker.bucket_bytes, worker._specs, worker.threads = "float32", 1, None, NoThreads()
    worker.turns = DeviceTurns(parts, lambda: None, "cuda", sleep_level=level, offload_optimizer=False, enabled=True)
    worker.run("learner", "update")  # the engine sleeps for the update
    served = worker.push(1)
    expected = worker.run("learner", "weights_fingerprint", "float32")
    worker.run("rollout", "check_weights", served, "hybrid-0", expected)
    assert parts.calls == [("sleep", level), ("wake_up", "weights"), ("load", 1, 1), ("fingerprint",),
                           ("wake_up", "kv_cache"), ("check", 1)]


class Budgets:
    """A learner's trainer or a reference: records the `reserved` bytes its `auto` budget is resolved with."""

    def __init__(self, params: int = 0):
        self.model = torch.nn.Linear(params, 1, bias=False) if params else None
        self.resolved: list[float] = []

    def resolve_token_budget(self, reserved: float = 0.0) -> None:
        self.resolved.append(reserved)


@pytest.mark.parametrize("offload", [False, True])
def test_the_budgets_are_resolved_beside_every_part_and_the_reference_leaves_room_for_adamw(offload):
    """Once every part is built and the engine asleep: the learner's budget from the free memory as it is, the
    reference's less the learner's AdamW moments (8 bytes for each of its 1000 trained parameters), which are on the
    device while the reference scores unless they leave it while the engine generates."""
    worker = object.__new__(hybrid.HybridWorker)
    trainer, reference = Budgets(params=1000), Budgets()
    worker.learner = type("FakeLearner", (), {"trainer": trainer})()
    worker.parts = {"learner": worker.learner, "reference": reference}
    worker.turns = DeviceTurns(FakeParts(), lambda: None, "cuda", sleep_level=1, offload_optimizer=offload,
                               enabled=True)
    worker.resolve_token_budgets()
    assert trainer.resolved == [0.0] and reference.resolved == [0 if offload else 8_000]


def test_a_learner_sharing_its_device_waits_to_resolve_its_budget(tiny_model_dir):
    cfg = config.LearnerConfig(max_tokens_per_micro_batch="auto")
    learner = Learner(config.ModelConfig(path=str(tiny_model_dir)), cfg, config.LossConfig(), temperature=1.0,
                      norm_len=4, mini_batch_size=8, total_optimizer_steps=1, seed=0, share_device=True)
    assert learner.trainer.token_budget is None
    with pytest.raises(RuntimeError, match="'auto' is not resolved yet"):
        learner.trainer.micro_batches(test_learner.batch().sequences)
    learner.trainer.resolve_token_budget()
    assert learner.trainer.token_budget == 8192  # the CPU's
    reference = ReferenceWorker(config.ReferenceConfig(max_tokens_per_micro_batch="auto"),
                                config.ModelConfig(path=str(tiny_model_dir)), 1.0, share_device=True)
    with pytest.raises(RuntimeError, match="'auto' is not resolved yet"):
        reference.logprobs(test_learner.batch().sequences)
    reference.resolve_token_budget()
    assert reference.token_budget == 8192


# ---------------------------------------------------------------------------------------------------- views
class FakeHybrid:
    def __init__(self):
        self.calls: list[tuple] = []

    def run(self, part: str, method: str, *args, **kwargs):
        self.calls.append((part, method, args, kwargs))
        return f"{part}.{method}"


def test_a_role_view_calls_its_part_of_the_same_actors():
    hybrids = LocalGroup("hybrid", LocalBackend(), lambda i, incarnation: FakeHybrid(), 2)
    learner, rollout = RoleView(hybrids, "learner"), RoleView(hybrids, "rollout")
    assert LocalBackend().get(learner.call(1, Learner.update, "batch", k=1)) == "learner.update"
    assert LocalBackend().get(rollout.map(RolloutWorker.version)) == ["rollout.version"] * 2
    assert LocalBackend().get(RoleView(hybrids, "reference").call(0, ReferenceWorker.logprobs, "s")) \
        == "reference.logprobs"
    assert hybrids.workers[1].calls == [("learner", "update", ("batch",), {"k": 1}), ("rollout", "version", (), {})]
    assert len(learner) == 2 and learner.name(1) == "hybrid-1" and learner.incarnations is hybrids.incarnations
    with pytest.raises(RuntimeError, match="hosts a learner: it cannot be replaced alone"):
        rollout.restart(0)


# ------------------------------------------------------------------------------------------- a real local run
def test_a_hybrid_run_equals_the_same_run_with_every_role_apart(tmp_path, tiny_model_dir):
    """Same seeds, same weights (the fingerprint check verifies every push), same engine settings: the hybrid
    actor's in-memory push must give exactly the rows that the object store's push gives."""
    from distrl.driver import train

    def run(name: str, *extra: str) -> list[dict]:
        cfg = quickstart(f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path}", f"run.name={name}",
                         "run.progress=false", "run.tensorboard=false", "cluster.backend=local", "run.steps=3",
                         "run.checkpoint_at_end=false", *extra)
        return train(cfg)

    apart, hybrid = run("apart"), run("hybrid", "cluster.colocate=hybrid")
    keys = ["reward/mean", "loss/policy", "loss/kl", "kl/ref", "learner/tokens", "learner/grad_norm"]
    assert [[h[k] for k in keys] for h in hybrid] == [[h[k] for k in keys] for h in apart]
    assert len({h["reward/mean"] for h in apart}) > 1  # the weights changed between the steps


def test_a_hybrid_push_that_loads_other_weights_fails_its_check(tmp_path, tiny_model_dir, monkeypatch):
    """The in-memory push is checked like any other: an engine that loads weights other than its learner's (here
    one tensor scaled on the way, from the second push on) ends the run with the check's error."""
    from distrl.driver import train
    from distrl.workers.weights.fingerprint import WeightMismatch

    buckets = hybrid.HybridWorker._buckets

    def corrupted(self, specs):
        for i, bucket in enumerate(buckets(self, specs)):
            tensors = assemble(bucket)
            name = next(iter(tensors))
            scale = 1.5 if i == 0 and self.learner.weights_version() > 0 else 1.0
            yield BucketParts(bucket.spec, [Pieces.whole({**tensors, name: tensors[name] * scale})])

    monkeypatch.setattr(hybrid.HybridWorker, "_buckets", corrupted)
    cfg = quickstart(f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path}", "run.progress=false",
                     "run.tensorboard=false", "cluster.backend=local", "run.steps=2", "run.checkpoint_at_end=false",
                     "cluster.colocate=hybrid")
    with pytest.raises(WeightMismatch, match=r"serves weights other than the learners' after loading version 1"):
        train(cfg)
