"""The critic in local mode (plain class, no Ray): a value head on the policy's backbone, seeded; values read where
the policy's logits are; micro-batching exact; updates fit the returns; its checkpoint part resumes it exactly."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_learner import batch as policy_batch

from distrl import checkpoint
from distrl.config import CriticConfig, ModelConfig
from distrl.merging import values
from distrl.types.batches import TrainBatch
from distrl.workers.training.critic import Critic
from distrl.workers.training.model import load_causal_lm


def make_critic(model_dir, seed: int = 0, **cfg) -> Critic:
    critic_cfg = CriticConfig(**{"lr": 1e-3, "micro_batch_size": 8, "max_grad_norm": None, **cfg})
    return Critic(ModelConfig(path=str(model_dir)), critic_cfg, mini_batch_size=8, total_optimizer_steps=50,
                  seed=seed)


def batch(returns: float = 1.0) -> TrainBatch:
    """The learner tests' batch (ragged prompts and responses) with returns from -1 to +1 by row and no values yet."""
    data = policy_batch()
    ret = torch.linspace(-1, 1, data.batch_size)[:, None] * returns * data.response_mask
    return replace(data, old_logprobs=None, advantages=torch.zeros_like(ret), old_values=torch.zeros_like(ret),
                   returns=ret.contiguous())


def with_values(critic: Critic, data: TrainBatch) -> TrainBatch:
    """`data` with the critic's own values as old_values, as the driver builds it before an update."""
    return replace(data, old_values=critic.values(data.sequences))


def test_value_head_on_the_policy_backbone_seeded(tiny_model_dir):
    a, b, c = make_critic(tiny_model_dir), make_critic(tiny_model_dir), make_critic(tiny_model_dir, seed=1)
    head = [dict(x.model.named_parameters())["score.weight"] for x in (a, b, c)]
    assert head[0].shape == (1, a.model.config.hidden_size)
    assert torch.equal(head[0], head[1]) and not torch.equal(head[0], head[2])
    # The backbone is the policy's, loaded (not initialised): equal to the causal LM's.
    policy = dict(load_causal_lm(ModelConfig(path=str(tiny_model_dir)), "float32").named_parameters())
    for name, param in a.model.named_parameters():
        if not name.startswith("score."):
            torch.testing.assert_close(param, policy[name], rtol=0, atol=0)


def test_values_are_read_before_each_response_token_and_ignore_left_padding(tiny_model_dir):
    critic = make_critic(tiny_model_dir)
    seqs = batch().sequences
    v = critic.values(seqs)
    assert v.shape == (8, 6) and v.dtype == torch.float32
    assert (v[4:, 4:] == 0).all() and (v[4:, :4] != 0).all()
    # Row 0 (prompt left-padded by 2) unpadded and alone: the value of response token t is the head at the hidden
    # state of position P - 1 + t, the prompt's last token for t = 0.
    row = seqs.select(slice(0, 1))
    ids = row.input_ids[:, 2:]
    with torch.no_grad():
        logits = critic.model(input_ids=ids).logits[0, :, 0]
    torch.testing.assert_close(v[0], logits[1:7], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("micro_batch_size", [1, 4])
def test_micro_batches_give_the_full_batch_update(tiny_model_dir, micro_batch_size):
    after = []
    for size in (8, micro_batch_size):
        critic = make_critic(tiny_model_dir, micro_batch_size=size)
        figs = values(critic.update(with_values(critic, batch())))
        after.append((dict(critic.model.named_parameters())["score.weight"].detach().clone(), figs))
    (whole, whole_figs), (micro, micro_figs) = after
    torch.testing.assert_close(micro, whole, rtol=1e-5, atol=1e-7)
    for key in ("critic/value_loss", "critic/vf_clipfrac", "critic/values_mean", "critic/grad_norm"):
        assert micro_figs[key] == pytest.approx(whole_figs[key], rel=1e-4, abs=1e-7), key


def test_updates_fit_the_returns(tiny_model_dir):
    critic = make_critic(tiny_model_dir, value_clip=None)
    losses = [values(critic.update(with_values(critic, batch())))["critic/value_loss"] for _ in range(15)]
    assert losses[-1] < 0.3 * losses[0], losses
    figs = values(critic.update(with_values(critic, batch())))
    assert set(figs) >= {"critic/value_loss", "critic/vf_clipfrac", "critic/values_mean", "critic/grad_norm",
                         "critic/lr", "critic/tokens"}


def test_clipped_updates_report_their_clip_fraction(tiny_model_dir):
    # Returns far from the values, a small clip and a large lr: after the first step of two epochs the values move
    # beyond the clip range, and those tokens are counted.
    critic = make_critic(tiny_model_dir, value_clip=0.01, lr=1e-2, ppo_epochs=2)
    figs = values(critic.update(with_values(critic, batch(returns=5.0))))
    assert 0 < figs["critic/vf_clipfrac"] <= 1


def test_update_without_returns_is_refused(tiny_model_dir):
    data = replace(batch(), old_values=None, returns=None)
    with pytest.raises(ValueError, match="old_values and returns"):
        make_critic(tiny_model_dir).update(data)


def test_checkpoint_part_resumes_exactly(tiny_model_dir, tmp_path: Path):
    first = make_critic(tiny_model_dir)
    first.update(with_values(first, batch()))
    tmp = checkpoint.begin(tmp_path / "step_1")
    written = first.save_checkpoint(str(tmp / "critic"), "float32")
    path = checkpoint.finish(tmp, {"step": 1}, {"critic": [written]})
    assert checkpoint.problem(path) is None
    second = make_critic(tiny_model_dir, seed=7)  # another head: the checkpoint must replace it
    second.load_checkpoint(str(path / "critic"))
    nxt = batch(returns=2.0)
    a, b = values(first.update(with_values(first, nxt))), values(second.update(with_values(second, nxt)))
    assert a["critic/value_loss"] == pytest.approx(b["critic/value_loss"], rel=1e-6)
    for (name, p), q in zip(first.model.named_parameters(), second.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_in_the_synchronous_loop_the_critic_shares_the_cores_with_the_learner_and_reference(monkeypatch):
    from distrl import config
    from distrl.cluster.roles import role_threads

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    c = config.from_dict({"model": {"path": "m"}, "data": {"path": "d"}, "loss": {"kl": {"coef": 0.01}},
                          "algorithm": {"advantage": "gae"}, "critic": {},
                          "cluster": {"num_cpus": 6, "rollout": {"num_actors": 2, "num_cpus": 1.0},
                                      "learner": {"num_cpus": 1.0}, "reference": {"num_cpus": 0.5},
                                      "critic": {"num_cpus": 0.5}}})
    # The critic scores its values beside the reference (and the learner), and updates beside the learner: the
    # three take turns with the engines, so they split the 6 cores among their 3 actors; the 2 engines take 3 each.
    assert [role_threads(role, c) for role in ("rollout", "reference", "learner", "critic")] == [3, 2, 2, 2]
