"""The learner in local mode (plain class, no Ray): micro-batching is exact, steps move the policy the way the
advantages say, non-finite steps are skipped then stop the run, and a checkpoint (free of pickle) resumes it
exactly."""

import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from distrl import checkpoint
from distrl.batching import select_by_covariance
from distrl.config import (
    CISPOConfig,
    ClipCovConfig,
    GMPOConfig,
    GPGConfig,
    KLCovConfig,
    LearnerConfig,
    LossConfig,
    ModelConfig,
    RatioCorrection,
    SAPOConfig,
)
from distrl.merging import values
from distrl.types.batches import Sequences, TrainBatch
from distrl.workers.training.learner import Learner, NonFiniteError


def make_learner(model_dir, loss: LossConfig | None = None, **learner) -> Learner:
    cfg = LearnerConfig(**{"lr": 1e-2, "micro_batch_size": 8, "max_grad_norm": None, **learner})
    return Learner(ModelConfig(path=str(model_dir)), cfg, loss or LossConfig(), temperature=1.0, norm_len=6,
                   mini_batch_size=8, total_optimizer_steps=10, seed=0)


def batch(advantage: float = 1.0) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    b, p, t = 8, 4, 6
    ids = torch.randint(3, 200, (b, p + t), generator=g)
    attention = torch.ones(b, p + t, dtype=torch.long)
    attention[:2, :2] = 0  # left-padded prompts
    mask = torch.ones(b, t)
    mask[4:, 4:] = 0  # shorter responses
    attention[4:, p + 4 :] = 0
    adv = torch.linspace(-1, 1, b)[:, None].expand(b, t) * advantage
    seqs = Sequences(input_ids=ids, attention_mask=attention, response_mask=mask, rollout_logprobs=torch.zeros(b, t),
                     policy_version=torch.zeros(b, dtype=torch.long),
                     response_versions=torch.zeros(b, t, dtype=torch.long))
    return TrainBatch(seqs, old_logprobs=torch.zeros(b, t), advantages=adv.contiguous(), ref_logprobs=None)


def scored(learner: Learner, data: TrainBatch) -> TrainBatch:
    """`data` with the learner's own log-probs as old_logprobs, as the driver builds it before an update."""
    return replace(data, old_logprobs=learner.logprobs(data.sequences))


def update(learner: Learner, data: TrainBatch) -> dict[str, float]:
    return values(learner.update(data))


def save(learner: Learner, path: Path, step: int) -> Path:
    """A checkpoint of `learner` alone at `path`, written as the driver has it written."""
    tmp = checkpoint.begin(path)
    written = learner.save_checkpoint(str(tmp / "policy"), "float32")
    return checkpoint.finish(tmp, {"step": step}, {"policy": [written]})


def weights(learner: Learner) -> dict[str, torch.Tensor]:
    (everything,) = learner.weight_specs(2**40, "float32")
    # Cloned: float32 weights on the CPU come back as the parameters themselves, which the next step changes.
    return {name: w.clone() for name, w in learner.weight_bucket(everything, "float32").items()}


def step_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> float:
    """Largest difference between the weights `a` and `b` reached from `before`, relative to the change a made, after
    allowing two float32 roundings of each weight (norm weights near 1.0 change by ~1e-3, where one ulp of the
    weight, 1.2e-7, is already 1e-4 of the change)."""
    eps = torch.finfo(torch.float32).eps
    return max((((a[k] - b[k]).abs() - 2 * eps * before[k].abs()).clamp(min=0).max()
                / (a[k] - before[k]).abs().max().clamp(min=1e-12)).item() for k in a)


@pytest.mark.parametrize("micro_batch_size", [1, 2, 4])
def test_micro_batches_give_the_full_batch_gradient(tiny_model_dir, micro_batch_size):
    after = []
    for size in (8, micro_batch_size):
        learner = sgd(make_learner(tiny_model_dir, micro_batch_size=size))
        before = weights(learner)
        update(learner, scored(learner, batch()))
        after.append(weights(learner))
    worst = step_difference(*after, before)
    assert worst < 1e-5, f"relative gradient difference {worst}"


def test_metrics_are_token_means_over_the_whole_batch(tiny_model_dir):
    # Micro-batches of 4 rows hold 24 and 16 response tokens: their per-token means must be weighted 24:16 to give
    # the figure one micro-batch of 8 reports (mismatch_kl = mean over tokens of rollout - old = -old here).
    loss = LossConfig(correction=RatioCorrection(mode="tis", low=0.0, high=2.0))
    reports = [make_learner(tiny_model_dir, loss, micro_batch_size=size) for size in (8, 4)]
    whole, split = (update(learner, scored(learner, batch())) for learner in reports)
    assert split["mismatch_kl"] == pytest.approx(whole["mismatch_kl"], rel=1e-5)
    assert whole["learner/tokens"] == split["learner/tokens"] == 40


def sgd(learner: Learner) -> Learner:
    """Plain SGD with lr 1: the weight change is the gradient (Adam's first step, ~lr x sign(g), would turn float
    rounding in near-zero gradients into visible weight differences)."""
    trainer = learner.trainer
    trainer.optimizer = torch.optim.SGD(trainer.params, lr=1.0)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)
    return learner


@pytest.mark.parametrize("micro_batch_size", [8, 4])
def test_old_logprobs_taken_from_the_update_equal_recomputed_ones(tiny_model_dir, micro_batch_size):
    # A batch without old log-probs is one optimizer step from the proximal policy: the update's own log-probs,
    # detached, are the old ones. The step, its metrics and the log-probs handed back match the recomputing path.
    loss = LossConfig(correction=RatioCorrection(mode="tis", low=0.0, high=2.0))
    given, taken = (sgd(make_learner(tiny_model_dir, loss, micro_batch_size=micro_batch_size)) for _ in range(2))
    before = weights(given)
    recomputed = scored(given, batch())
    given_metrics = update(given, recomputed)
    taken_metrics = update(taken, replace(batch(), old_logprobs=None))
    assert torch.allclose(taken.proximal_logprobs(), recomputed.old_logprobs, atol=1e-6)  # rows in order
    a, b = weights(given), weights(taken)
    worst = step_difference(a, b, before)
    assert worst < 1e-5, f"relative weight-change difference {worst}"
    for key in ("loss/policy", "mismatch_kl", "is_weight_mean", "clip_frac", "ppo_kl"):
        assert taken_metrics[key] == pytest.approx(given_metrics[key], rel=1e-5, abs=1e-7), key


def test_old_logprobs_are_taken_from_the_update_only_for_one_optimizer_step(tiny_model_dir):
    learner = make_learner(tiny_model_dir)
    no_old = replace(batch(), old_logprobs=None)
    with pytest.raises(ValueError, match="one optimizer step"):
        update(learner, TrainBatch.concat([no_old, no_old]))  # two mini-batches of 8
    with pytest.raises(ValueError, match="one optimizer step"):
        make_learner(tiny_model_dir, ppo_epochs=2).update(no_old)
    update(learner, scored(learner, batch()))
    with pytest.raises(RuntimeError, match="was given its old log-probs"):
        learner.proximal_logprobs()


def test_a_batch_labelled_one_mini_batch_is_one_optimizer_step_whatever_its_rows(tiny_model_dir):
    """Episodes of several sequences make more rows than the config's mini-batch (8): `TrainBatch.shard` labels
    them one mini-batch, which is one step, its old log-probs taken from the update; two mini-batches are not."""
    no_old = replace(batch(), old_logprobs=None)
    eleven = TrainBatch.concat([no_old, no_old.select(slice(0, 3))])
    learner = make_learner(tiny_model_dir)
    (one,) = eleven.shard(1, mini_batches=1)
    assert update(learner, one)["learner/optimizer_steps"] == 1
    assert learner.proximal_logprobs().shape == (11, 6)
    (two,) = eleven.shard(1, mini_batches=2)
    with pytest.raises(ValueError, match="one optimizer step"):
        update(learner, two)


def test_update_raises_logprobs_of_positive_advantage_samples(tiny_model_dir):
    learner = make_learner(tiny_model_dir, lr=1e-3)
    data = batch()
    before = learner.logprobs(data.sequences)
    for _ in range(3):
        metrics = update(learner, scored(learner, data))
    delta = ((learner.logprobs(data.sequences) - before) * data.response_mask).sum(-1)
    assert delta[-1] > 0 > delta[0]  # advantages run from -1 (row 0) to +1 (row 7)
    assert metrics["learner/optimizer_steps"] == 3 and metrics["learner/skipped_steps"] == 0
    assert {"loss/policy", "clip_frac", "ppo_kl", "learner/grad_norm", "learner/lr"} <= metrics.keys()


def test_non_finite_steps_are_skipped_then_stop(tiny_model_dir):
    learner = make_learner(tiny_model_dir, max_consecutive_nonfinite=2)
    before = weights(learner)
    metrics = update(learner, scored(learner, batch(advantage=float("nan"))))
    assert metrics["learner/skipped_steps"] == 1 and metrics["learner/optimizer_steps"] == 0
    assert all(torch.equal(before[k], v) for k, v in weights(learner).items())
    with pytest.raises(NonFiniteError, match="2 consecutive optimizer steps"):
        update(learner, scored(learner, batch(advantage=float("nan"))))


def test_a_checkpoint_resumes_the_learner_exactly(tiny_model_dir, tmp_path):
    # Cosine schedule with warm-up: the learning rate differs at every step, so a scheduler restored wrongly shows.
    settings = dict(lr=1e-3, warmup_steps=2, lr_schedule="cosine", max_consecutive_nonfinite=3)
    data = batch()
    run = make_learner(tiny_model_dir, **settings)
    for advantage in (1.0, float("nan"), 1.0):  # the skipped step must be counted after resuming too
        update(run, scored(run, batch(advantage)))
    path = save(run, tmp_path / "step_000003", 3)

    resumed = make_learner(tiny_model_dir, **settings)
    resumed.load_checkpoint(str(path / "policy"), 3)
    assert resumed.weights_version() == 3
    run_t, resumed_t = run.trainer, resumed.trainer
    saved, loaded = run_t.optimizer.state_dict(), resumed_t.optimizer.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]  # betas still a tuple, initial_lr kept
    assert saved["state"].keys() == loaded["state"].keys() and len(saved["state"]) == len(run_t.params)
    for i, state in saved["state"].items():
        assert state.keys() == loaded["state"][i].keys()
        assert all(torch.equal(state[k], loaded["state"][i][k]) for k in state)
    assert resumed_t.scheduler.state_dict() == run_t.scheduler.state_dict()
    assert resumed_t.scheduler.get_last_lr() == run_t.scheduler.get_last_lr()
    assert (resumed_t.optimizer_steps, resumed_t.skipped_steps, resumed_t.consecutive_nonfinite) == (2, 1, 0)
    assert all(torch.equal(weights(run)[k], v) for k, v in weights(resumed).items())

    after_run, after_resumed = update(run, scored(run, data)), update(resumed, scored(resumed, data))
    assert after_resumed["learner/lr"] == after_run["learner/lr"]
    assert all(torch.equal(weights(run)[k], v) for k, v in weights(resumed).items())


def test_a_checkpoint_holds_no_pickle(tiny_model_dir, tmp_path, monkeypatch):
    learner = make_learner(tiny_model_dir)
    update(learner, scored(learner, batch()))
    path = save(learner, tmp_path / "step_000001", 1)
    files = [f for f in path.rglob("*") if f.is_file()]
    assert {f.relative_to(path).as_posix() for f in files} >= {
        "policy/model/config.json", "policy/model/model.safetensors", "policy/trainer_state.safetensors",
        "policy/trainer_state.json", "driver_state.json", "manifest.json"}
    assert all(f.suffix in (".safetensors", ".json", ".jinja") for f in files), files  # .jinja: the chat template
    # torch.save writes a zip archive (PK), older versions and pickle.dump a stream opening with PROTO (0x80).
    assert not [f for f in files if f.read_bytes()[:4] == b"PK\x03\x04" or f.read_bytes()[:1] == b"\x80"]

    def refuse(*args, **kwargs):
        raise AssertionError("loading a checkpoint must not unpickle anything")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    make_learner(tiny_model_dir).load_checkpoint(str(path / "policy"), 1)


def ragged_batch() -> TrainBatch:
    """8 rows whose responses run from 2 to 8 tokens (4x), prompts from 2 to 4, in no order of length."""
    g = torch.Generator().manual_seed(3)
    b, p, t = 8, 4, 8
    prompt_lens, response_lens = [4, 2, 3, 4, 2, 3, 4, 2], [8, 2, 5, 3, 7, 4, 6, 2]
    attention = torch.zeros(b, p + t, dtype=torch.long)
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        attention[i, p - pl : p + rl] = 1
    mask = attention[:, p:].float()
    seqs = Sequences(input_ids=torch.randint(3, 200, (b, p + t), generator=g), attention_mask=attention,
                     response_mask=mask, rollout_logprobs=-torch.rand(b, t, generator=g) * mask,
                     policy_version=torch.zeros(b, dtype=torch.long),
                     response_versions=torch.zeros(b, t, dtype=torch.long))
    adv = (torch.linspace(-1, 1, b)[:, None] * mask).contiguous()
    return TrainBatch(seqs, old_logprobs=None, advantages=adv, ref_logprobs=None)


@pytest.mark.parametrize("max_tokens", [12, 30])
def test_a_token_budget_gives_the_fixed_count_update(tiny_model_dir, max_tokens):
    # Budget 12 puts most rows (6-12 real tokens) alone; 30 packs two or three rows per micro-batch, in an order
    # that is not the rows'. Loss, metrics and weights match one micro-batch of all 8 rows.
    loss = LossConfig(correction=RatioCorrection(mode="tis", low=0.0, high=2.0), entropy_coef=0.01)
    fixed = sgd(make_learner(tiny_model_dir, loss, micro_batch_size=8))
    budget = sgd(make_learner(tiny_model_dir, loss, micro_batch_size=8, max_tokens_per_micro_batch=max_tokens))
    before = weights(fixed)
    data = ragged_batch()
    fixed_metrics = update(fixed, scored(fixed, data))
    budget_metrics = update(budget, scored(budget, data))
    assert fixed_metrics.keys() == budget_metrics.keys()
    differ = {key for key, value in fixed_metrics.items()
              if budget_metrics[key] != pytest.approx(value, rel=1e-5, abs=1e-7)}
    # The effective sample size (sum w)^2 / (n sum w^2) of a micro-batch is not a mean over its tokens, so its
    # merge over micro-batches depends on the partition (as it does between fixed counts of 8 and 4 rows).
    assert differ == {"is_ess"}, {k: (fixed_metrics[k], budget_metrics[k]) for k in differ}
    a, b = weights(fixed), weights(budget)
    worst = step_difference(a, b, before)
    assert worst < 1e-5, f"relative weight-change difference {worst}"


def test_proximal_logprobs_come_back_in_row_order_under_a_token_budget(tiny_model_dir):
    learner = make_learner(tiny_model_dir, max_tokens_per_micro_batch=20)
    expected = learner.logprobs(ragged_batch().sequences)
    learner.update(ragged_batch())
    assert torch.allclose(learner.proximal_logprobs(), expected, atol=1e-6)


def test_a_checkpoint_is_resumed_only_with_the_strategy_that_wrote_it(tiny_model_dir, tmp_path, monkeypatch):
    path = save(make_learner(tiny_model_dir), tmp_path / "step_000001", 1)
    resumed = make_learner(tiny_model_dir)
    monkeypatch.setattr(resumed.strategy, "name", "fsdp")  # as a learner of a run with learner.strategy fsdp
    with pytest.raises(RuntimeError, match=r"written by learners with learner\.strategy 'replicate', and this run "
                                           r"has 'fsdp'"):
        resumed.load_checkpoint(str(path / "policy"), 1)


# Every other loss, with parameters that make it act on this tiny batch: clip ranges that bind once the first step has
# moved the weights, and covariance fractions that select a few of its 37 tokens per mini-batch.
OTHER_LOSSES = [CISPOConfig(clip_low=0.2, clip_high=0.2), SAPOConfig(), GMPOConfig(clip_low=0.1, clip_high=0.1),
                GPGConfig(), ClipCovConfig(clip_cov_ratio=0.1, clip_cov_lb=0.0), KLCovConfig(kl_cov_ratio=0.1)]


@pytest.mark.parametrize("policy", OTHER_LOSSES, ids=[p.type for p in OTHER_LOSSES])
def test_every_loss_trains_the_same_in_micro_batches_and_packed_as_in_one_pass(tiny_model_dir, policy):
    # Two mini-batches of the 8 ragged rows each, through the learner's chunked head: one micro-batch of 8 rows,
    # padded micro-batches of 2 rows, and packed micro-batches under a budget of 30 tokens give the same figures and
    # the same weights. The old log-probs are the learner's moved by +-0.05 (a stale batch): ratios leave 1 from
    # the first step, so that the clips, gates and KL-Cov's penalty act (at r = 1 exactly, |log r|'s gradient would
    # be the sign of the passes' rounding). The covariance losses get the tokens the driver selects over each whole
    # mini-batch.
    loss = LossConfig(policy=policy, correction=RatioCorrection(mode="tis", low=0.0, high=2.0), entropy_coef=0.01)
    learners = [sgd(make_learner(tiny_model_dir, loss, micro_batch_size=size, **budget))
                for size, budget in ((8, {}), (2, {}), (8, {"max_tokens_per_micro_batch": 30}))]
    before = weights(learners[0])
    data = scored(learners[0], TrainBatch.concat([ragged_batch(), ragged_batch()]))
    shift = 0.05 * torch.where(torch.arange(8) % 2 == 0, 1.0, -1.0) * data.response_mask
    data = replace(data, old_logprobs=data.old_logprobs + shift)
    if isinstance(policy, ClipCovConfig | KLCovConfig):
        selected = select_by_covariance(data.old_logprobs, data.advantages, data.response_mask, policy, 2, seed=0)
        assert selected.sum() == 2 * 3  # floor(0.1 x 37) = 3 in each mini-batch
        data = replace(data, cov_selected=selected)
    figures = [update(learner, data) for learner in learners]
    assert figures[0]["learner/optimizer_steps"] == 2
    for other in figures[1:]:
        differ = {key for key, value in figures[0].items() if other[key] != pytest.approx(value, rel=1e-5, abs=1e-7)}
        assert differ <= {"is_ess"}, {k: (figures[0][k], other[k]) for k in differ}  # is_ess: see the budget test
    for learner in learners[1:]:
        worst = step_difference(weights(learners[0]), weights(learner), before)
        assert worst < 1e-5, f"relative weight-change difference {worst}"
