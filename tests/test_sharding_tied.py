"""Sharded checkpoints of a model with tied embeddings (distrl's tiny Qwen2, as Qwen2.5): two FSDP learners (gloo)
write their shards, the tied weight once (safetensors refuses two names on one storage), and load them back into
the trained weights, the head still tied to the embedding."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from test_learner import batch, make_learner
from test_learner_fsdp import full_weights
from test_sharding import _spawn

from distrl import checkpoint
from distrl.config import FSDPStrategy
from distrl.workers.training.sharding.load import aliases


def scenario_tied(rank: int, world: int, port: int, model_dir: Path, out: Path) -> dict:
    """Update, checkpoint, update again, load the checkpoint: the weights at the checkpoint, and after loading."""
    learner = make_learner(model_dir, strategy=FSDPStrategy(), lr=1e-3, micro_batch_size=2)
    learner.connect("127.0.0.1", port, rank, world)
    assert aliases(learner.model) == {"lm_head.weight": "model.embed_tokens.weight"}
    shard = batch().shard(world, 1)[rank]
    learner.update(replace(shard, old_logprobs=learner.logprobs(shard.sequences)))
    saved = dict(full_weights(learner))
    if rank == 0:  # as the driver does around the learners' writes
        checkpoint.begin(out / "step_000001")
    torch.distributed.barrier()
    written = [None] * world
    torch.distributed.all_gather_object(written, learner.save_checkpoint(str(out / "step_000001.tmp" / "policy")))
    if rank == 0:
        checkpoint.finish(out / "step_000001.tmp", {"step": 1}, {"policy": written})
    torch.distributed.barrier()
    learner.update(replace(shard, old_logprobs=learner.logprobs(shard.sequences)))
    moved = dict(full_weights(learner))
    learner.load_checkpoint(str(out / "step_000001" / "policy"), 1)
    loaded = dict(full_weights(learner))
    return {"saved": saved, "moved": moved, "loaded": loaded}


def test_a_tied_models_sharded_checkpoint_saves_the_tied_weight_once_and_loads(tmp_path):
    from distrl.workers.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "qwen2", arch="qwen2")
    result = _spawn("test_sharding_tied:scenario_tied", model_dir, tmp_path)
    saved, moved, loaded = result["saved"], result["moved"], result["loaded"]
    assert any(not torch.equal(saved[k], moved[k]) for k in saved)  # the second update moved the weights
    for name, weight in saved.items():
        torch.testing.assert_close(loaded[name], weight, rtol=0, atol=0, msg=name)
    assert torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])
