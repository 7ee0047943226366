"""`learner.lora` with `learner.strategy: fsdp`: two learners in a real gloo group on the CPU (spawned by
`tests.test_sharding._spawn`) shard the frozen base and replicate the adapters; they train as one replicated LoRA
learner on the whole batch (same losses, same adapters), answer the reference (adapters disabled) as it does, and
write a PEFT-format checkpoint that it loads."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from test_learner import batch, update
from test_lora import make_lora_learner
from test_sharding import _spawn

from distrl import checkpoint
from distrl.config import FSDPStrategy
from distrl.merging import values
from distrl.workers.training import lora

UPDATES = 2


def adapters(learner) -> dict[str, torch.Tensor]:
    (everything,) = learner.weight_specs(2**40, "float32")
    return learner.weight_bucket(everything, "float32")  # every learner takes part; learner 0's holds them


def scenario(rank: int, world: int, port: int, model_dir: Path, out: Path) -> dict:
    learner = make_lora_learner(model_dir, strategy=FSDPStrategy())
    learner.connect("127.0.0.1", port, rank, world)
    assert all(p.requires_grad == ("lora_" in n) for n, p in learner.model.named_parameters())
    shard = batch().shard(world, 1)[rank]
    losses, refs = [], []
    for _ in range(UPDATES):
        scored = replace(shard, old_logprobs=learner.logprobs(shard.sequences))
        losses.append(values(learner.update(scored))["loss/policy"])
        refs.append(learner.ref_logprobs(shard.sequences))
    written: list = [None] * world  # every learner's files, for the manifest (the driver gets them from each)
    torch.distributed.all_gather_object(written, learner.save_checkpoint(str(out / "step_000002.tmp" / "policy")))
    return {"losses": torch.tensor(losses), "ref": refs[-1], "written": written, "fingerprint_size": torch.tensor(
        len(learner.weights_fingerprint("float32"))), **adapters(learner)}


def test_sharded_base_with_replicated_adapters_trains_as_one_lora_learner(tiny_model_dir, tmp_path):
    tmp = checkpoint.begin(tmp_path / "step_000002")
    result = _spawn("test_lora_fsdp:scenario", tiny_model_dir, tmp_path)
    path = checkpoint.finish(tmp, {"step": 2}, {"policy": result.pop("written")})

    single = make_lora_learner(tiny_model_dir)
    data = batch()
    losses = [update(single, replace(data, old_logprobs=single.logprobs(data.sequences)))["loss/policy"]
              for _ in range(UPDATES)]
    torch.testing.assert_close(result.pop("losses"), torch.tensor(losses), rtol=1e-5, atol=1e-7)
    mine = batch().shard(2, 1)[0].sequences
    torch.testing.assert_close(result.pop("ref"), single.ref_logprobs(mine), rtol=0, atol=1e-5)
    expected = adapters(single)
    assert int(result.pop("fingerprint_size")) == len(expected)
    assert result.keys() == expected.keys()
    for name, w in expected.items():  # AdamW divides by a running RMS: rounding shows at the scale of lr
        torch.testing.assert_close(result[name], w, rtol=0, atol=3e-5, msg=name)

    assert checkpoint.problem(path) is None
    assert (path / "policy" / lora.ADAPTER_DIR / "adapter_model.safetensors").is_file()
    assert not (path / "policy" / "shards").exists()  # the base comes from the model's files
    resumed = make_lora_learner(tiny_model_dir)
    resumed.load_checkpoint(str(path / "policy"), 2)
    for name, w in adapters(resumed).items():
        torch.testing.assert_close(w, result[name], rtol=0, atol=0, msg=name)
