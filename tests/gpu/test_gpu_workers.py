"""The plain worker classes on one CUDA GPU in bfloat16: a learner's update (replicated, and FSDP with one rank over
NCCL, its export and sharded checkpoint too), the reference's and the critic's steps. Log-probs are compared with the
same worker in float32 on the CPU: bfloat16 rounds the tiny model's log-probs (magnitude ~6) by ~0.03, so they must
agree to 0.15 (a wrong mask, layout or device shows as errors of order 1)."""

from __future__ import annotations

from dataclasses import replace

import torch
from test_critic import batch as critic_batch
from test_learner import batch

from distrl import checkpoint
from distrl.config import CriticConfig, FSDPStrategy, LearnerConfig, LossConfig, ModelConfig, ReferenceConfig
from distrl.merging import values
from distrl.workers.training import dist
from distrl.workers.training.critic import Critic
from distrl.workers.training.learner import Learner
from distrl.workers.training.reference import ReferenceWorker

BF16_LOGPROB_ATOL = 0.15


def make_learner(model_dir, num_gpus: float = 1.0, **learner) -> Learner:
    cfg = LearnerConfig(**{"lr": 1e-3, "micro_batch_size": 4, "dtype": "bfloat16", **learner})
    return Learner(ModelConfig(path=str(model_dir)), cfg, LossConfig(), temperature=1.0, norm_len=6,
                   mini_batch_size=8, total_optimizer_steps=10, seed=0, num_gpus=num_gpus)


def assert_trains(learner: Learner) -> list[float]:
    """Two updates of test_learner's batch (old log-probs from the learner): finite losses and gradient norms."""
    data = batch()
    losses = []
    for _ in range(2):
        figs = values(learner.update(replace(data, old_logprobs=learner.logprobs(data.sequences))))
        assert torch.isfinite(torch.tensor([figs["loss/policy"], figs["learner/grad_norm"]])).all(), figs
        assert figs["learner/skipped_steps"] == 0
        losses.append(figs["loss/policy"])
    return losses


def test_a_replicated_learner_trains_in_bf16_on_cuda(tiny_model_dir, tiny_qwen2_dir):
    for model_dir in (tiny_model_dir, tiny_qwen2_dir):
        learner = make_learner(model_dir)
        assert learner.device == "cuda" and next(learner.model.parameters()).is_cuda
        cpu = make_learner(model_dir, num_gpus=0, dtype="float32")
        seqs = batch().sequences
        torch.testing.assert_close(learner.logprobs(seqs), cpu.logprobs(seqs), rtol=0, atol=BF16_LOGPROB_ATOL)
        before = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
        assert_trains(learner)
        after = learner.model.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before), "no weight moved"
        # float32 master weights, cast to bfloat16 once per forward pass; AdamW fused (one kernel, counters on the GPU)
        assert all(v.dtype == torch.float32 for v in after.values())
        assert learner.trainer.optimizer.defaults["fused"] is True


def test_the_reference_scores_in_bf16_on_cuda(tiny_qwen2_dir):
    model = ModelConfig(path=str(tiny_qwen2_dir))
    gpu = ReferenceWorker(ReferenceConfig(dtype="bfloat16"), model, temperature=1.0, num_gpus=1)
    cpu = ReferenceWorker(ReferenceConfig(dtype="float32"), model, temperature=1.0)
    assert next(gpu.model.parameters()).dtype == torch.bfloat16 and gpu.device == "cuda"
    seqs = batch().sequences
    scored = gpu.logprobs(seqs)
    assert scored.device.type == "cpu" and scored.dtype == torch.float32
    torch.testing.assert_close(scored, cpu.logprobs(seqs), rtol=0, atol=BF16_LOGPROB_ATOL)


def test_the_critic_fits_returns_in_bf16_on_cuda(tiny_qwen2_dir):
    critic = Critic(ModelConfig(path=str(tiny_qwen2_dir)),
                    CriticConfig(lr=1e-3, micro_batch_size=4, dtype="bfloat16", max_grad_norm=None, value_clip=None),
                    mini_batch_size=8, total_optimizer_steps=20, seed=0, num_gpus=1)
    assert critic.device == "cuda"
    data = critic_batch()
    losses = [values(critic.update(replace(data, old_values=critic.values(data.sequences))))["critic/value_loss"]
              for _ in range(10)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.5 * losses[0], losses


def test_fsdp_with_one_rank_over_nccl_trains_exports_and_checkpoints(tiny_qwen2_dir, tmp_path):
    learner = make_learner(tiny_qwen2_dir, strategy=FSDPStrategy())
    try:
        assert learner.connect("127.0.0.1", dist.free_port("127.0.0.1"), 0, 1) == "nccl"
        assert_trains(learner)
        (everything,) = learner.weight_specs(2**40, "bfloat16")
        bucket = learner.weight_bucket(everything, "bfloat16")  # gathered from the shards, on the CPU
        assert {name for name, _ in everything} == bucket.keys()
        assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in bucket.values())
        fingerprint = learner.weights_fingerprint("bfloat16")
        assert len(fingerprint) > 0
        tmp = checkpoint.begin(tmp_path / "step_000002")
        written = learner.save_checkpoint(str(tmp / "policy"), "bfloat16")
        path = checkpoint.finish(tmp, {"step": 2}, {"policy": [written]})
        assert checkpoint.problem(path) is None
        assert (path / "policy" / "model" / "config.json").exists()
    finally:
        learner.close()
