"""FSDP2 sharding (`distrl.workers.training.sharding`) in real 2-process gloo groups on the CPU, against plain replicas.

Each scenario runs in two spawned processes (`_spawn`: 127.0.0.1, a free port, a time limit); rank 0 writes what it
measured to a file that the test compares with a 1-process run made here. The training step is the learners' data
parallelism in miniature: every rank takes its rows of the batch in micro-batches, divides its partial loss by the
*global* response-token count, gradients are summed across ranks (FSDP's reduce-scatter made a sum;
`dist.all_reduce_grads_` for replicas), the global norm is clipped, AdamW steps. The ranks' rows hold different
token counts, so a mean instead of a sum, or a local instead of a global count, would show.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from pathlib import Path

import pytest
import torch

ROWS, PROMPT, RESPONSE, VOCAB = 8, 3, 5, 96
STEPS, MICRO, LR, MAX_NORM = 3, 2, 1e-2, 0.5


# ---------------------------------------------------------------------------------------------------- the data
def make_batches(steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    """`steps` batches of `ROWS` sequences: ids `[B, P + T]`, response mask `[B, T]` (rows 0-3 full, rows 4-7 two
    tokens: rank 0 has 4 x 5 = 20 tokens, rank 1 has 2 x 5 + 2 x 2 = 14), advantages `[B]`."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        mask = torch.ones(ROWS, RESPONSE)
        mask[ROWS // 2 + 2 :, 2:] = 0
        batches.append({"ids": torch.randint(0, VOCAB, (ROWS, PROMPT + RESPONSE), generator=g), "mask": mask,
                        "adv": torch.randn(ROWS, generator=g)})
    return batches


def rows(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    n = ROWS // world
    return {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}


def partial_loss(model, part: dict[str, torch.Tensor], num_tokens: float) -> torch.Tensor:
    """Policy-gradient loss of `part`'s response tokens divided by the global token count: -sum(A * log p) / N."""
    logits = model(input_ids=part["ids"]).logits[:, PROMPT - 1 : -1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, part["ids"][:, PROMPT:, None]).squeeze(-1)
    return -(part["adv"][:, None] * logp * part["mask"]).sum() / num_tokens


def train(model, optimizer, batches, rank: int, world: int, reduce_grads) -> list[tuple[float, float]]:
    """One AdamW step per batch; returns (loss summed over micro-batches and ranks, grad norm) per step."""
    from distrl.workers.training import dist
    from distrl.workers.training.sharding import clip_grad_norm_

    out = []
    for batch in batches:
        num_tokens = float(batch["mask"].sum())  # global: every rank sees the whole batch's count
        mine = rows(batch, rank, world)
        loss = torch.zeros((), dtype=torch.float64)
        for start in range(0, ROWS // world, MICRO):
            term = partial_loss(model, {k: v[start : start + MICRO] for k, v in mine.items()}, num_tokens)
            term.backward()
            loss += term.detach().double()
        reduce_grads(model)
        norm = clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append((float(dist.all_reduce_(loss)), float(norm)))
    return out


def adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def full_weights(model) -> dict[str, torch.Tensor]:
    """The float32 state dict, gathered bucket by bucket (small buckets: several gathers); rank 0 only."""
    from distrl.workers.training.sharding import gather_bucket
    from distrl.workers.weights.export import specs as weight_specs

    out: dict[str, torch.Tensor] = {}
    for spec in weight_specs(model, 64 * 2**10, torch.float32):
        bucket = gather_bucket(model, spec, torch.float32)
        if bucket is not None:
            out.update(bucket)
    return out


# ---------------------------------------------------------------------------------------- 2-process scenarios
def _replicate(model_dir: Path):
    from transformers import AutoModelForCausalLM

    from distrl.workers.training import dist

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, lambda m: dist.all_reduce_grads_(list(m.parameters()))


def _fsdp(model_dir: Path, **kwargs):
    from distrl.workers.training.sharding import learner_mesh, load_sharded_causal_lm

    return load_sharded_causal_lm(model_dir, learner_mesh("cpu"), **kwargs), lambda m: None


def scenario_numerics(rank: int, world: int, model_dir: Path, out: Path) -> dict:
    """replicate and fsdp, each from the same files, over the same batches."""
    result = {}
    for name, build in (("replicate", _replicate), ("fsdp", _fsdp)):
        model, reduce_grads = build(model_dir)
        loaded = full_weights(model)
        result[name] = {"loaded": loaded, "log": train(model.train(), adamw(model), make_batches(), rank, world,
                                                       reduce_grads),
                        "weights": full_weights(model)}
    return result


def scenario_checkpoint(rank: int, world: int, model_dir: Path, out: Path) -> dict:
    """Train 1 step, save, train 2 more (A); a fresh model + optimizer loads the save and trains the same 2 (B)."""
    from distrl.workers.training.sharding import load, save, save_hf

    batches = make_batches()
    model, _ = _fsdp(model_dir)
    optimizer = adamw(model)
    train(model.train(), optimizer, batches[:1], rank, world, lambda m: None)
    save(out / "dcp", model, optimizer)
    straight = train(model, optimizer, batches[1:], rank, world, lambda m: None)
    save_hf(model, out / "hf", bucket_bytes=64 * 2**10)
    weights = full_weights(model)

    fresh, _ = _fsdp(model_dir)
    fresh_optimizer = adamw(fresh)
    load(out / "dcp", fresh, fresh_optimizer)
    resumed = train(fresh.train(), fresh_optimizer, batches[1:], rank, world, lambda m: None)
    return {"straight": straight, "resumed": resumed, "weights": weights, "resumed_weights": full_weights(fresh)}


def scenario_offload(rank: int, world: int, model_dir: Path, out: Path) -> dict:
    """A tied Qwen2 model with CPU offload, against replicas; and one bfloat16-compute step."""
    result: dict = {}
    for name, build in (("replicate", _replicate), ("fsdp", lambda d: _fsdp(d, cpu_offload=True))):
        model, reduce_grads = build(model_dir)
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        log = train(model.train(), adamw(model), make_batches(2), rank, world, reduce_grads)
        result[name] = {"tied": tied, "log": log, "weights": full_weights(model)}
    bf16, _ = _fsdp(model_dir, compute_dtype=torch.bfloat16)
    log = train(bf16.train(), adamw(bf16), make_batches(1), rank, world, lambda m: None)
    result["bf16"] = {"log": log, "param_dtype": str(next(bf16.parameters()).dtype)}
    return result


def scenario_export(rank: int, world: int, model_dir: Path, out: Path) -> dict:
    """After a training step: the weights gathered in float32 and in bfloat16 (shards cast before the gather), and
    how many times each rank waited for its gathers (`bound_run_ahead`) against the buckets it gathered."""
    import torch.distributed

    from distrl.workers.training.sharding import export as sharded_export
    from distrl.workers.weights.export import specs as weight_specs

    model, _ = _fsdp(model_dir)
    train(model.train(), adamw(model), make_batches(1), rank, world, lambda m: None)
    waits: list[str] = []
    sharded_export.bound_run_ahead = waits.append  # type: ignore[assignment]  # counted, not run (gloo: a no-op)
    bf16: dict[str, torch.Tensor] = {}
    buckets = weight_specs(model, 64 * 2**10, torch.bfloat16)
    for spec in buckets:
        bucket = sharded_export.gather_bucket(model, spec, torch.bfloat16)
        if bucket is not None:
            bf16.update(bucket)
    counts: list[list[str] | None] = [None] * world
    torch.distributed.all_gather_object(counts, waits)
    return {"float32": full_weights(model), "bfloat16": bf16, "waits": counts, "buckets": len(buckets)}


def scenario_experts(rank: int, world: int, model_dir: Path, out: Path) -> dict:
    """A mixture of experts whose files hold each expert apart: every rank reads its experts into the stacks."""
    model, _ = _fsdp(model_dir)
    return {"weights": full_weights(model)}


SCENARIOS = {"numerics": scenario_numerics, "checkpoint": scenario_checkpoint, "offload": scenario_offload,
             "export": scenario_export, "experts": scenario_experts}


def _worker(rank: int, world: int, port: int, scenario: str, model_dir: Path, out: Path) -> None:
    from distrl.workers.training.dist import init_process_group, leave_process_group

    torch.set_num_threads(1)
    run = SCENARIOS.get(scenario) or _learner_scenario(scenario)
    if scenario in SCENARIOS:  # a learner scenario joins the group itself (Learner.connect)
        init_process_group("127.0.0.1", port, rank, world, "cpu")
    try:
        torch.manual_seed(0)
        result = run(rank, world, model_dir, out) if scenario in SCENARIOS else run(rank, world, port, model_dir, out)
        if rank == 0:
            torch.save(result, out / "result.pt")
    except BaseException:
        (out / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:  # a learner scenario's learners leave at exit (`Learner.close`)
        leave_process_group()


def _learner_scenario(name: str):
    """A scenario of tests/test_learner_fsdp.py (`module:function`), which builds `Learner`s that connect."""
    import importlib

    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(scenario: str, model_dir: Path, out: Path, world: int = 2, timeout: float = 420) -> dict:
    """Run `scenario` on `world` spawned ranks; rank 0's result. Fails with the ranks' tracebacks, or after
    `timeout` seconds (a rank left waiting in a collective)."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.start_processes(_worker, args=(world, _free_port(), scenario, model_dir, out), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        # join returns False while some rank still runs (it wakes when any one ends)
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"scenario {scenario} did not finish within {timeout} s (a rank left in a collective?)")
    except mp.ProcessExitedException:
        errors = "\n".join(p.read_text() for p in sorted(out.glob("error-*.txt")))
        pytest.fail(f"scenario {scenario} failed:\n{errors}")
    except mp.ProcessRaisedException as e:
        pytest.fail(f"scenario {scenario} failed:\n{e}")
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
    return torch.load(out / "result.pt", weights_only=True)


def _single(model_dir: Path, steps: int = STEPS) -> tuple[list, dict[str, torch.Tensor]]:
    """The 1-learner reference: the whole batch on this process."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    log = train(model, adamw(model), make_batches(steps), 0, 1, lambda m: None)
    return log, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_close_logs(a, b, rtol=1e-5):
    for (loss_a, norm_a), (loss_b, norm_b) in zip(a, b, strict=True):
        assert loss_a == pytest.approx(loss_b, rel=rtol, abs=1e-7)
        assert norm_a == pytest.approx(norm_b, rel=rtol)


def assert_close_weights(a: dict, b: dict, atol=1e-3 * LR * STEPS):
    """Three AdamW steps of lr 1e-2 move weights by up to ~3e-2. AdamW divides each gradient by its running RMS,
    so the float32 rounding of a near-zero gradient (summed in another order) comes out at the scale of lr, not of
    the gradient: the bound is 1/1000 of the largest possible motion (measured: up to 1.0e-5)."""
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, f"max |delta weight| {worst}"


# ------------------------------------------------------------------------------------------------------ tests
def test_clip_grad_norm_hand_worked():
    from distrl.workers.training.sharding import clip_grad_norm_

    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert float(clip_grad_norm_([a, b], 1.0)) == pytest.approx(5.0)  # sqrt(3^2 + 4^2)
    assert torch.allclose(a.grad, torch.tensor([0.6, 0.0]), atol=1e-6)  # x 1 / 5
    assert torch.allclose(b.grad, torch.tensor([0.8]), atol=1e-6)
    assert float(clip_grad_norm_([a, b], float("inf"))) == pytest.approx(1.0)  # only measured
    assert torch.allclose(b.grad, torch.tensor([0.8]), atol=1e-6)


def test_decoder_layers_come_from_no_split_modules(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from distrl.workers.training.sharding import decoder_layer_classes

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert decoder_layer_classes(model) == (LlamaDecoderLayer,)
    model._no_split_modules = []
    with pytest.raises(ValueError, match=r"strategy 'fsdp' \(learner\.strategy or critic\.strategy\).*"
                                         r"_no_split_modules"):
        decoder_layer_classes(model)


def test_weight_buckets_and_hf_export_of_an_unsharded_model(tiny_model_dir, tmp_path):
    """One process, no group: the same functions serve a plain model (rank 0 is this process)."""
    from transformers import AutoModelForCausalLM

    from distrl.workers.training.sharding import save_hf
    from distrl.workers.weights.export import specs as weight_specs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    embed = vocab * hidden * 2  # bytes of the [V, H] embedding in bfloat16
    specs = weight_specs(model, embed, torch.bfloat16)
    assert specs[0] == [("model.embed_tokens.weight", (vocab, hidden))]  # exactly one bucket's worth
    assert len(specs) > 2
    assert [n for spec in specs for n, _ in spec] == list(model.state_dict())
    save_hf(model, tmp_path / "hf", torch.bfloat16, bucket_bytes=embed)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    assert loaded.dtype == torch.bfloat16
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16)), name


@pytest.fixture(scope="module")
def numerics(tiny_model_dir, tmp_path_factory):
    return _spawn("numerics", tiny_model_dir, tmp_path_factory.mktemp("numerics"))


def test_loading_shard_by_shard_gives_the_files_weights(numerics, tiny_model_dir):
    from safetensors.torch import load_file

    files = load_file(tiny_model_dir / "model.safetensors")
    assert numerics["fsdp"]["loaded"].keys() == files.keys()
    for name, tensor in files.items():
        assert torch.equal(numerics["fsdp"]["loaded"][name], tensor), name


def test_fsdp_on_two_learners_equals_replicas_and_one_learner(numerics, tiny_model_dir):
    single_log, single_weights = _single(tiny_model_dir)
    assert all(norm > MAX_NORM for _, norm in single_log), "the clip should act in every step"
    for name in ("replicate", "fsdp"):
        assert_close_logs(numerics[name]["log"], single_log)
        assert_close_weights(numerics[name]["weights"], single_weights)
    # Three steps of lr 1e-2 moved the weights far more than the tolerance.
    moved = max((single_weights[k] - numerics["fsdp"]["loaded"][k]).abs().max().item() for k in single_weights)
    assert moved > 1e-2


def test_checkpoint_round_trip_continues_exactly_and_holds_no_pickle(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    result = _spawn("checkpoint", tiny_model_dir, tmp_path)
    assert_close_logs(result["resumed"], result["straight"], rtol=1e-6)
    assert_close_weights(result["resumed_weights"], result["weights"], atol=1e-7)
    written = sorted(p.name for p in (tmp_path / "dcp").iterdir())
    assert written == ["optimizer_groups.json", "shard-00001-model-00001-of-00001.safetensors",
                       "shard-00002-model-00001-of-00001.safetensors"]
    # The HF export loads with transformers, with the trained weights.
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1  # one file per bucket
    assert_close_weights(dict(exported), result["weights"], atol=0.0)


def test_tied_model_with_cpu_offload_equals_replicas(tmp_path):
    """distrl's tiny Qwen2 (tied embeddings, QKV bias, grouped-query attention)."""
    from distrl.workers.tiny_model import make_tiny_model

    make_tiny_model(tmp_path / "qwen2", arch="qwen2")
    result = _spawn("offload", tmp_path / "qwen2", tmp_path)
    single_log, single_weights = _single(tmp_path / "qwen2", steps=2)
    for name in ("replicate", "fsdp"):
        assert result[name]["tied"], name
        assert_close_logs(result[name]["log"], single_log)
        assert_close_weights(result[name]["weights"], single_weights)
    exported = result["fsdp"]["weights"]
    assert torch.equal(exported["lm_head.weight"], exported["model.embed_tokens.weight"])
    # bfloat16 compute: float32 master weights, a loss within bfloat16 rounding of the float32 one.
    assert result["bf16"]["param_dtype"] == "torch.float32"
    assert result["bf16"]["log"][0][0] == pytest.approx(single_log[0][0], rel=2e-2)


def test_shards_are_gathered_in_the_export_dtype_and_every_rank_waits_for_each_bucket(tiny_model_dir, tmp_path):
    """Gathering the shards cast to bfloat16 gives exactly the gathered float32 weights cast to bfloat16 (the cast
    is elementwise); each rank, not only rank 0, waits for its gathers once per bucket (on CUDA this bounds the
    all-gathers a rank other than 0 queues, and holds, to one bucket)."""
    result = _spawn("export", tiny_model_dir, tmp_path)
    full, bf16 = result["float32"], result["bfloat16"]
    assert bf16.keys() == full.keys() and result["buckets"] > 2
    for name, tensor in full.items():
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], tensor.to(torch.bfloat16)), name
    assert result["waits"] == [["cpu"] * result["buckets"]] * 2


def test_on_cuda_a_rank_waits_for_its_queued_gathers(monkeypatch):
    """`bound_run_ahead` synchronises the current CUDA stream (the all-gathers' outputs are then released); on the
    CPU it has nothing to wait for."""
    from types import SimpleNamespace

    from distrl.workers.training.sharding.export import bound_run_ahead

    synced: list[str] = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(synchronize=lambda: synced.append("x")))
    bound_run_ahead("cpu")
    assert synced == []
    bound_run_ahead("cuda")
    assert synced == ["x"]


def test_a_bucket_goes_to_the_device_asked_for(tiny_model_dir):
    """A bucket bound for an NCCL push is asked for on the GPU, and is put there (not through the CPU); here the
    meta device stands for it, on a plain model."""
    from transformers import AutoModelForCausalLM

    from distrl.workers.training.sharding import gather_bucket
    from distrl.workers.weights.export import specs as weight_specs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    spec = weight_specs(model, 2**20, torch.bfloat16)[0]
    bucket = gather_bucket(model, spec, torch.bfloat16, device="meta")
    assert bucket is not None and {(t.device.type, t.dtype) for t in bucket.values()} == {("meta", torch.bfloat16)}


def test_the_hf_export_of_a_mixture_of_experts_is_save_pretrained_s(tiny_mixtral_dir, tmp_path):
    """Expert stacks go back to the checkpoint's experts, Mixtral's `mlp` to `block_sparse_moe`: the files hold what
    `save_pretrained` writes (vLLM's Mixtral loads no other names), bucket by bucket."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from distrl.workers.training.sharding import save_hf

    model = AutoModelForCausalLM.from_pretrained(tiny_mixtral_dir)
    save_hf(model, tmp_path / "hf", bucket_bytes=2**16)
    model.save_pretrained(tmp_path / "theirs")
    ours = {k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    theirs = load_file(tmp_path / "theirs" / "model.safetensors")
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in ours
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_sharded_learners_read_each_experts_tensors_into_their_stacks(arch, request, tmp_path):
    """The files hold experts one by one (Qwen3-MoE's gate_proj/up_proj/down_proj, Mixtral's block_sparse_moe w1/w3/
    w2); two ranks, each holding 4 of the 8 experts of every stack, gather exactly transformers' loaded model."""
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    gathered = _spawn("experts", model_dir, tmp_path)["weights"]
    expected = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert gathered.keys() == expected.keys()
    assert all(torch.equal(gathered[k], expected[k]) for k in expected)
