"""`learner.strategy: fsdp` through the `Learner` itself: two learners in a real gloo group on the CPU (spawned by
`tests.test_sharding._spawn`) score, update, export and checkpoint a sharded policy, and agree with one replicated
learner on the whole batch: the same losses, the same weights, and a checkpoint a replicated learner loads."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_learner import batch, make_learner, update
from test_sharding import _spawn

from distrl import checkpoint
from distrl.batching import select_by_covariance
from distrl.config import ClipCovConfig, FSDPStrategy, KLCovConfig, LossConfig, ReplicateStrategy
from distrl.merging import Figures, merge, values
from distrl.types.batches import TrainBatch
from distrl.workers.weights.export import Bucket
from distrl.workers.weights.fingerprint import add, first_mismatch, of_blocks
from distrl.workers.weights.pieces import BucketParts, Pieces, assemble

UPDATES = 2
SETTINGS = {"lr": 1e-3, "micro_batch_size": 2}


def full_weights(learner) -> dict[str, torch.Tensor]:
    (everything,) = learner.weight_specs(2**40, "float32")
    return learner.weight_bucket(everything, "float32")  # every learner takes part; learner 0's holds them


def scenario(rank: int, world: int, port: int, model_dir: Path, out: Path, shard: TrainBatch | None = None,
             **settings) -> dict:
    """Two sharded learners on their shards of test_learner's batch (dealt by length, `TrainBatch.shard`: rows
    [0, 2, 4, 6] and [1, 3, 5, 7], 34 tokens each), or on the `shard` given."""
    learner = make_learner(model_dir, strategy=FSDPStrategy(), **{**SETTINGS, **settings})
    learner.connect("127.0.0.1", port, rank, world)
    shard = batch().shard(world, 1)[rank] if shard is None else shard
    losses = []
    for _ in range(UPDATES):
        scored = replace(shard, old_logprobs=learner.logprobs(shard.sequences))
        losses.append(values(learner.update(scored))["loss/policy"])
    saved = {}
    if not settings:  # every learner's files, for the manifest (the driver gets them from each)
        written: list = [None] * world
        torch.distributed.all_gather_object(written, learner.save_checkpoint(str(out / "step_000002.tmp" / "policy"),
                                                                             "float32"))
        # What each learner sends of a push, and its part of the fingerprint of the regions TP 2 workers hold.
        (everything,) = learner.weight_specs(2**40, "float32")
        pieces: list = [None] * world
        torch.distributed.all_gather_object(pieces, learner.weight_pieces(everything, "float32"))
        parts: list = [None] * world
        torch.distributed.all_gather_object(parts, learner.weights_fingerprint("float32", PUSH_REGIONS))
        blocks = [{name: (p.rows[name], torch.as_tensor(p.tensors[name])) for name in p.tensors} for p in pieces]
        saved = {"written": written, "push": (everything, blocks, parts)}
    return {"losses": torch.tensor(losses), **saved, **full_weights(learner)}


def scenario_budget(rank: int, world: int, port: int, model_dir: Path, out: Path) -> dict:
    """A token budget of 16 on contiguous halves of the batch (not the balanced shards, whose equal lengths make
    equal counts): learner 0's rows (8, 8, 10, 10 tokens) make 3 micro-batches, learner 1's (8 tokens each) 2, so
    learner 1 must split one to keep the forward passes in lockstep."""
    from distrl.micro_batches import micro_batches

    assert len(micro_batches([8, 8, 10, 10], 2, 16)) == 3 and len(micro_batches([8, 8, 8, 8], 2, 16)) == 2
    half = replace(batch(), mini_batch=torch.zeros(8, dtype=torch.long)).select(slice(4 * rank, 4 * rank + 4))
    return scenario(rank, world, port, model_dir, out, shard=half, max_tokens_per_micro_batch=16)


def uneven_batch():
    """9 rows (test_learner's 8 and its first again) in 2 mini-batches: rows 0-3 and 4-8 (`TrainBatch.shard`)."""
    data = batch()
    return TrainBatch.concat([data, data.select(slice(0, 1))])


def scenario_uneven(rank: int, world: int, port: int, model_dir: Path, out: Path, strategy: str) -> dict:
    """Two learners on a batch whose rows do not divide evenly: mini-batches [0..3] and [4..8] (real tokens 8 8 10
    10 | 8 8 8 8 8), dealt by length (`TrainBatch.shard`): learner 0 holds rows [0, 2 | 4, 6], learner 1 [1, 3 |
    5, 7, 8]; with micro-batches of 2 rows learner 1 needs 2 forward passes for its second part, learner 0 one
    (FSDP keeps them in lockstep)."""
    learner = make_learner(model_dir, strategy=FSDPStrategy() if strategy == "fsdp" else ReplicateStrategy(),
                           **SETTINGS)
    learner.connect("127.0.0.1", port, rank, world)
    shard = uneven_batch().shard(world, 2)[rank]
    losses = []
    for _ in range(UPDATES):
        scored = replace(shard, old_logprobs=learner.logprobs(shard.sequences))
        losses.append(values(learner.update(scored))["loss/policy"])
    return {"losses": torch.tensor(losses), **full_weights(learner)}


def scenario_uneven_replicate(rank: int, world: int, port: int, model_dir: Path, out: Path) -> dict:
    return scenario_uneven(rank, world, port, model_dir, out, "replicate")


def scenario_uneven_fsdp(rank: int, world: int, port: int, model_dir: Path, out: Path) -> dict:
    return scenario_uneven(rank, world, port, model_dir, out, "fsdp")


@pytest.mark.parametrize("strategy", ["replicate", "fsdp"])
def test_two_learners_on_an_uneven_batch_train_as_one_learner_on_all_of_it(tiny_model_dir, tmp_path, strategy):
    assert [rows.tolist() for rows in uneven_batch().shard_rows(2, 2)] == [[0, 2, 4, 6], [1, 3, 5, 7, 8]]
    result = _spawn(f"test_learner_fsdp:scenario_uneven_{strategy}", tiny_model_dir, tmp_path)
    single = make_learner(tiny_model_dir, **SETTINGS)
    (whole,) = uneven_batch().shard(1, 2)
    figs = [update(single, replace(whole, old_logprobs=single.logprobs(whole.sequences))) for _ in range(UPDATES)]
    assert figs[-1]["learner/optimizer_steps"] == 2 * UPDATES  # 2 mini-batches per update (of 4 and 5 rows)
    assert_same_training(result, [f["loss/policy"] for f in figs], full_weights(single))


PUSH_REGIONS = {"model.embed_tokens.weight": [(0, 0, 256), (0, 256, 256)],
                "model.layers.0.self_attn.o_proj.weight": [(1, 0, 64), (1, 64, 64)],
                "model.norm.weight": [None]}
"""Regions of a few tensors as an engine at TP 2 holds them: vocabulary halves, row-parallel column halves, whole."""


# ------------------------------------------------------------------------------- Clip-Cov and KL-Cov over shards
COVARIANCE_LOSSES = [LossConfig(policy=ClipCovConfig(clip_cov_ratio=0.1, clip_cov_lb=0.0)),
                     LossConfig(policy=KLCovConfig(kl_cov_ratio=0.1))]
"""Fractions that select a few of the uneven batch's tokens in each of its two mini-batches (2 of 24, 2 of 22)."""


def covariance_batches(model_dir: Path) -> list[TrainBatch]:
    """`uneven_batch` (2 mini-batches) with old log-probs a fresh learner's moved by +-0.05 (a stale batch, whose
    ratios leave 1 from the first step) and, for each of COVARIANCE_LOSSES, the tokens the driver selects over each
    whole mini-batch (`select_by_covariance`), before the batch is dealt to the learners."""
    data = uneven_batch()
    shift = 0.05 * torch.where(torch.arange(6) % 2 == 0, 1.0, -1.0) * data.response_mask
    data = replace(data, old_logprobs=make_learner(model_dir, **SETTINGS).logprobs(data.sequences) + shift)
    return [replace(data, cov_selected=select_by_covariance(data.old_logprobs, data.advantages, data.response_mask,
                                                            loss.policy, 2, seed=0)) for loss in COVARIANCE_LOSSES]


def covariance_updates(learner, batches: list[TrainBatch]) -> list[Figures]:
    """Clip-Cov's update, then KL-Cov's, each on its batch (two optimizer steps each): each update's figures."""
    figures = []
    for loss, data in zip(COVARIANCE_LOSSES, batches, strict=True):
        learner.loss_cfg = loss  # one learner (one process group) trains with one loss, then the other
        figures.append(learner.update(data))
    return figures


def covariance_figures(updates: list[Figures]) -> dict[str, torch.Tensor]:
    return {key: torch.tensor([f[key].value for f in updates]) for key in ("loss/policy", "cov_frac",
                                                                           "learner/grad_norm")}


def scenario_covariance(rank: int, world: int, port: int, model_dir: Path, out: Path, strategy: str) -> dict:
    """Two learners, each on its shard of the batches `covariance_batches` made (saved by the test in `out`); their
    figures merged over both, as the driver merges them."""
    learner = make_learner(model_dir, strategy=FSDPStrategy() if strategy == "fsdp" else ReplicateStrategy(),
                           **SETTINGS)
    learner.connect("127.0.0.1", port, rank, world)
    saved = torch.load(out / "batches.pt", weights_only=True)
    batches = [replace(uneven_batch(), old_logprobs=saved["old_logprobs"], cov_selected=selected)
               for selected in saved["cov_selected"]]
    mine = covariance_updates(learner, [data.shard(world, 2)[rank] for data in batches])
    every: list = [None] * world
    torch.distributed.all_gather_object(every, mine)
    merged = [merge(parts, [p["learner/tokens"].value for p in parts]) for parts in zip(*every, strict=True)]
    return {**covariance_figures(merged), **full_weights(learner)}


def scenario_covariance_replicate(rank: int, world: int, port: int, model_dir: Path, out: Path) -> dict:
    return scenario_covariance(rank, world, port, model_dir, out, "replicate")


def scenario_covariance_fsdp(rank: int, world: int, port: int, model_dir: Path, out: Path) -> dict:
    return scenario_covariance(rank, world, port, model_dir, out, "fsdp")


@pytest.mark.parametrize("strategy", ["replicate", "fsdp"])
def test_two_learners_cut_and_penalise_the_tokens_the_whole_batch_selects(tiny_model_dir, tmp_path, strategy):
    # The selection travels with the rows: each learner's micro-batches (2 rows) act on exactly the tokens one
    # learner with the whole batch acts on, so the two train as that one does, step for step.
    batches = covariance_batches(tiny_model_dir)
    assert [int(b.cov_selected.sum()) for b in batches] == [4, 4]  # 2 in each mini-batch
    torch.save({"old_logprobs": batches[0].old_logprobs, "cov_selected": [b.cov_selected for b in batches]},
               tmp_path / "batches.pt")
    result = _spawn(f"test_learner_fsdp:scenario_covariance_{strategy}", tiny_model_dir, tmp_path)
    single = make_learner(tiny_model_dir, **SETTINGS)
    expected = covariance_figures(covariance_updates(single, [b.shard(1, 2)[0] for b in batches]))
    assert (expected["cov_frac"] > 0).all()
    for key in ("cov_frac", "loss/policy", "learner/grad_norm"):
        torch.testing.assert_close(result.pop(key), expected[key], rtol=1e-5, atol=1e-7, msg=key)
    weights = full_weights(single)
    assert result.keys() == weights.keys()
    for name, w in weights.items():
        torch.testing.assert_close(result[name], w, rtol=0, atol=3e-5, msg=name)


@pytest.fixture(scope="module")
def two_sharded(tiny_model_dir, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("learner_fsdp")
    tmp = checkpoint.begin(out / "step_000002")  # as the driver does before asking the learners
    result = _spawn("test_learner_fsdp:scenario", tiny_model_dir, out)
    result["push"] = result.pop("push")  # kept apart from the weights
    return result, checkpoint.finish(tmp, {"step": 2}, {"policy": result.pop("written")})


def single_learner_run(tiny_model_dir) -> tuple[list[float], dict[str, torch.Tensor]]:
    single = make_learner(tiny_model_dir, **SETTINGS)
    data = batch()
    losses = [update(single, replace(data, old_logprobs=single.logprobs(data.sequences)))["loss/policy"]
              for _ in range(UPDATES)]
    return losses, full_weights(single)


def assert_same_training(result: dict, losses: list[float], weights: dict[str, torch.Tensor]) -> None:
    torch.testing.assert_close(result.pop("losses"), torch.tensor(losses), rtol=1e-5, atol=1e-7)
    assert result.keys() == weights.keys()
    for name, w in weights.items():  # AdamW divides by a running RMS: rounding shows at the scale of lr
        torch.testing.assert_close(result[name], w, rtol=0, atol=3e-5, msg=name)


def test_two_sharded_learners_train_as_one_replicated_learner(two_sharded, tiny_model_dir):
    result = dict(two_sharded[0])
    result.pop("push")
    assert_same_training(result, *single_learner_run(tiny_model_dir))


def test_each_sharded_learner_sends_its_own_rows_and_fingerprints_them(two_sharded):
    """A push from two FSDP learners: each sends its own block of every tensor (about half the model, nothing
    gathered), the engine's assembly gives the full weights exactly, and the learners' fingerprint parts add up to
    the fingerprint of the full weights, region by region."""
    result = dict(two_sharded[0])
    spec, blocks, parts = result.pop("push")
    pieces = [Pieces(Bucket({n: t for n, (_, t) in b.items()}), {n: row for n, (row, _) in b.items()}) for b in blocks]
    weights = {name: result[name] for name, _ in spec}
    total = sum(t.numel() * t.element_size() for t in weights.values())
    assert all(0.45 * total < p.nbytes < 0.55 * total for p in pieces), [p.nbytes / total for p in pieces]
    assembled = assemble(BucketParts(spec, pieces))
    assert all(torch.equal(assembled[name], weights[name]) for name in weights)
    whole = of_blocks(((n, t, 0, t.shape[0]) for n, t in weights.items()), PUSH_REGIONS, torch.float32)
    assert set(whole) == {"model.embed_tokens.weight[0:0:256]", "model.embed_tokens.weight[0:256:256]",
                          "model.layers.0.self_attn.o_proj.weight[1:0:64]",
                          "model.layers.0.self_attn.o_proj.weight[1:64:64]", "model.norm.weight"}
    assert first_mismatch(whole, add(parts)) is None


def test_sharded_learners_under_a_token_budget_keep_in_lockstep(tiny_model_dir, tmp_path):
    result = _spawn("test_learner_fsdp:scenario_budget", tiny_model_dir, tmp_path)
    assert_same_training(result, *single_learner_run(tiny_model_dir))


def test_a_sharded_checkpoint_holds_an_hf_policy_and_no_pickle_and_loads_into_a_replica(two_sharded,
                                                                                        tiny_model_dir):
    result, path = two_sharded
    assert checkpoint.problem(path) is None
    files = sorted(f.relative_to(path).as_posix() for f in path.rglob("*") if f.is_file())
    assert any(f.startswith("policy/shards/") for f in files) and "policy/model/config.json" in files
    assert all(f.endswith((".safetensors", ".json", ".jinja")) for f in files), files  # .jinja: the chat template
    # The manifest, built from what each learner said it wrote, lists every file, learner 1's shard too.
    listed = json.loads((path / "manifest.json").read_text())["files"]
    assert sorted(listed) == [f for f in files if f != "manifest.json"]
    assert "policy/shards/shard-00002-model-00001-of-00001.safetensors" in listed
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path / "policy" / "model")
    for name, tensor in hf.state_dict().items():
        torch.testing.assert_close(tensor, result[name], rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------------------------------------------- critic
def critic_scenario(rank: int, world: int, port: int, model_dir: Path, out: Path) -> dict:
    """Two critics sharding the value model (a fresh head on the policy's files): values, two updates, values."""
    from test_critic import batch as critic_batch
    from test_critic import make_critic, with_values

    critic = make_critic(model_dir, strategy=FSDPStrategy(), micro_batch_size=2)
    critic.connect("127.0.0.1", port, rank, world)
    shard = critic_batch().shard(world, 1)[rank]
    before = critic.values(shard.sequences)
    losses = [values(critic.update(with_values(critic, shard)))["critic/value_loss"] for _ in range(UPDATES)]
    return {"before": before, "after": critic.values(shard.sequences), "losses": torch.tensor(losses)}


def test_two_sharded_critics_train_as_one_replicated_critic(tiny_model_dir, tmp_path):
    from test_critic import batch as critic_batch
    from test_critic import make_critic, with_values

    result = _spawn("test_learner_fsdp:critic_scenario", tiny_model_dir, tmp_path)
    single = make_critic(tiny_model_dir, micro_batch_size=2)
    data = critic_batch()
    before = single.values(data.sequences)
    losses = [values(single.update(with_values(single, data)))["critic/value_loss"] for _ in range(UPDATES)]
    after = single.values(data.sequences)
    # The head the sharded critics initialised is the replica's (same seed), and training moves both alike.
    mine = data.shard_rows(2, 1)[0]  # critic 0's rows, dealt by length (TrainBatch.shard)
    torch.testing.assert_close(result["before"], before[mine], rtol=0, atol=1e-6)
    torch.testing.assert_close(result["losses"], torch.tensor(losses), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(result["after"], after[mine], rtol=0, atol=1e-4)


# ------------------------------------------------------------------------------------------- leaving the group
GROUP_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")
"""The names torch gives the threads of a gloo group: its workers, gloo's TCP loop, the TCPStore server's loop."""


def group_threads() -> list[str]:
    """This process's threads that belong to a process group (Linux: /proc/self/task/*/comm)."""
    names = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    return sorted(name for name in names if name in GROUP_THREADS)


def exit_scenario(role: str, model_dir: str, port: int) -> None:
    """Run in a fresh process: a sharded learner (or critic) joins a 1-rank group, runs collectives, and the process
    exits normally. A handler registered first runs last at exit, after the learner's own (`Learner.close`), and
    prints which group threads are left."""
    import atexit
    import sys

    from test_critic import make_critic

    atexit.register(lambda: print("at exit:", group_threads(), flush=True))
    worker = make_learner(model_dir, strategy=FSDPStrategy()) if role == "learner" else \
        make_critic(model_dir, strategy=FSDPStrategy())
    worker.connect("127.0.0.1", port, 0, 1)
    if role == "learner":
        worker.logprobs(batch().sequences)
        full_weights(worker)  # gathers: the collective whose tensors a gloo worker thread let go of at exit
    else:
        worker.values(batch().sequences)
    print("connected:", group_threads(), flush=True)
    sys.exit(0)


@pytest.mark.parametrize("role", ["learner", "critic"])
def test_a_sharded_worker_leaves_its_group_before_the_interpreter_finalizes(role, tiny_model_dir):
    """A gloo worker thread that frees a collective's tensors during finalization aborts the process (see
    `distrl.workers.training.dist.leave_process_group`); the learner's exit handler ends those threads first."""
    import subprocess
    import sys

    from test_sharding import _free_port

    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)]), "OMP_NUM_THREADS": "1"}
    code = f"import test_learner_fsdp as t; t.exit_scenario({role!r}, {str(tiny_model_dir)!r}, {_free_port()})"
    done = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = dict(line.split(": ", 1) for line in done.stdout.splitlines() if line.startswith(("connected", "at exit")))
    # two gloo workers: the check sees the threads it looks for
    assert said["connected"] == str(sorted((*GROUP_THREADS, "pt_gloo_runloop")))
    assert said["at exit"] == "[]"
