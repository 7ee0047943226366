"""The distributed service for real: Ray actors, vLLM CPU engines, transformers learners, in one local cluster.

- 2 learners stay bit-identical after updates and match 1 learner on the same global batch (two mini-batches).
- After a sync, both rollout actors serve the new version and vLLM's log-probs equal the learner's (fp32) to 1e-4:
  the raw ones (prompt log-probs) and the sampled tokens' at temperature 0.8.
- Every topology (rollout actors x learners) trains end to end.
- A raising reward function fails the step with an error naming the function and the sample, or scores 0.
- Each engine proves it serves learner 0's weights (fingerprints), and refuses other weights, naming the tensor.
"""

import re
from dataclasses import replace
from pathlib import Path

import pytest
import ray
import torch

from distrl import merging
from distrl.batching import advantages, pad
from distrl.cluster.backend import RayBackend
from distrl.cluster.producer import Producer
from distrl.cluster.roles import started_roles, total_optimizer_steps
from distrl.config import Config, RecoveryConfig
from distrl.data.prompts import load_prompts
from distrl.data.stream import PromptStream
from distrl.driver import train
from distrl.types.batches import Sequences, TrainBatch
from distrl.types.rollouts import ScoredRollouts
from distrl.workers.model_files import load_tokenizer
from distrl.workers.rewards import RewardError
from distrl.workers.rollout.worker import RolloutWorker
from distrl.workers.training.learner import Learner
from distrl.workers.training.reference import ReferenceWorker
from distrl.workers.weights.fingerprint import WeightMismatch
from distrl.workers.weights.pieces import BucketParts

from .conftest import quickstart

ALL = 2**40  # one bucket holding every tensor


def weights(roles, i: int) -> dict[str, torch.Tensor]:
    """Learner i's own replica of the weights (the export answers from learner 0 only), read inside its actor (a
    lambda travels by value: the actor cannot import this test module)."""
    replica = lambda learner: {n: t.detach().clone() for n, t in learner.model.state_dict().items()}  # noqa: E731
    return ray.get(roles.learner.workers[i].__ray_call__.remote(replica))


@pytest.fixture(scope="class")
def two_by_two(ray_session, tmp_path_factory):
    """2 rollout actors x 2 learners, fp32 everywhere (no dtype mismatch), sampling at temperature 0.8, 16 samples
    per step in 2 mini-batches; weights pushed as version 0."""
    tmp = tmp_path_factory.mktemp("two_by_two")
    cfg = quickstart(tmp, "run.name=two-by-two", "rollout.dtype=float32", "rollout.sampling.temperature=0.8",
                     "cluster.rollout.num_actors=2", "cluster.learner.num_actors=2", "cluster.learner.num_cpus=0.25",
                     "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "learner.mini_batch_size=8",
                     "learner.micro_batch_size=4", "learner.lr=1e-4", "learner.warmup_steps=0")
    with started_roles(cfg, RayBackend(cfg.cluster)) as roles:
        roles.sync.push(version=0)
        yield cfg, roles


def generate_and_score(roles, prompts, reward) -> ScoredRollouts:
    """One batch of `prompts` through the producer (every prompt once, in order)."""
    producer = Producer(roles.rollout, PromptStream(prompts, shuffle=False), reward, prompts_per_step=len(prompts),
                        max_staleness=0, chunk_prompts=None, dynamic_sampling=None, load_weights=roles.sync.push_one,
                        recovery=RecoveryConfig(), call_timeout_s=600.0)
    return producer.next_batch(step=1)[0]


def old_logprobs(roles, sequences: Sequences) -> torch.Tensor:
    return torch.cat(ray.get(roles.learner.map_shards(Learner.logprobs, sequences.split(len(roles.learner)))))


def update(roles, batch: TrainBatch, mini_batch_size: int) -> dict[str, float]:
    shards = batch.shard(len(roles.learner), batch.batch_size // mini_batch_size)
    results = ray.get(roles.learner.map_shards(Learner.update, shards))
    return merging.values(merging.merge(results, [r["learner/tokens"].value for r in results]))


def one_step_batch(cfg, roles):
    tokenizer = load_tokenizer(cfg.model)
    prompts, _ = load_prompts(cfg.data, tokenizer)
    scored = generate_and_score(roles, prompts[: cfg.rollout.prompts_per_step], cfg.reward)
    sequences = pad(scored.rollouts, tokenizer.pad_token_id)
    old = old_logprobs(roles, sequences)
    ref_shards = sequences.split(len(roles.reference))
    ref = torch.cat(ray.get(roles.reference.map_shards(ReferenceWorker.logprobs, ref_shards)))
    # Make sure the step has signal even if all rewards tie: perturb deterministically.
    rewards = torch.tensor(scored.rewards) + torch.linspace(0, 1, len(scored.rewards))
    adv, _ = advantages(rewards, sequences.response_mask, old, None, cfg.rollout.n_samples_per_prompt, cfg.algorithm,
                        cfg.loss.kl)
    return scored.rollouts, TrainBatch(sequences, old_logprobs=old, advantages=adv, ref_logprobs=ref)


class TestTwoRolloutActorsTwoLearners:
    """One 2 x 2 deployment shared by these tests; torn down before the full-run tests need the CPUs."""

    def test_two_learners_stay_identical_and_match_one_learner(self, two_by_two):
        cfg, roles = two_by_two
        _, batch = one_step_batch(cfg, roles)
        before = weights(roles, 0)
        metrics = update(roles, batch, cfg.mini_batch_size)
        after0, after1 = weights(roles, 0), weights(roles, 1)
        assert all(torch.equal(after0[k], after1[k]) for k in after0), "data-parallel replicas diverged"
        assert any(not torch.equal(before[k], after0[k]) for k in before), "the update changed nothing"
        assert metrics["learner/optimizer_steps"] == 2  # one per mini-batch

        # A second update on the same samples (new old log-probs): the replicas still agree to the bit.
        update(roles, replace(batch, old_logprobs=old_logprobs(roles, batch.sequences)), cfg.mini_batch_size)
        again0, again1 = weights(roles, 0), weights(roles, 1)
        assert all(torch.equal(again0[k], again1[k]) for k in again0), "data-parallel replicas diverged"

        # The same global batch on one in-process learner (local mode, plain class) gives the first update's
        # weights: the learners' shards were cut mini-batch by mini-batch, so the optimizer steps are the same.
        single = Learner(cfg.model, cfg.learner, cfg.loss, temperature=cfg.rollout.sampling.temperature,
                         norm_len=cfg.rollout.sampling.max_new_tokens, mini_batch_size=cfg.mini_batch_size,
                         total_optimizer_steps=total_optimizer_steps(cfg), seed=cfg.run.seed)
        single.update(batch)
        local = single.weight_bucket(*single.weight_specs(ALL, "float32"), "float32")
        worst = max((local[k] - after0[k]).abs().max().item() for k in local)
        # Gradients agree to float32 rounding; Adam's first steps (about lr * sign(g)) can amplify rounding in
        # near-zero gradients up to a few percent of lr, hence a bound relative to lr.
        assert worst < 0.05 * cfg.learner.lr, f"1 learner vs 2 learners differ by {worst}"

    def test_sync_sets_version_and_vllm_matches_learner(self, two_by_two):
        cfg, roles = two_by_two
        roles.sync.push(version=7)
        rollouts, batch = one_step_batch(cfg, roles)
        assert set(rollouts.policy_version) == {7}
        # Without stop strings vLLM samples without detokenizing; each response is decoded once, as vLLM would.
        tokenizer = load_tokenizer(cfg.model)
        assert rollouts.response_texts == tokenizer.batch_decode(rollouts.response_ids, skip_special_tokens=True)
        versions = set(ray.get(roles.rollout.map(RolloutWorker.version)))
        assert versions == {7}

        # The sampled tokens' log-probs under the distribution vLLM sampled from (temperature 0.8) are the
        # learner's temperature-scaled ones: the quantity the PPO ratio and the correction are built on.
        mask = batch.response_mask.bool()
        diff = (batch.rollout_logprobs - batch.old_logprobs)[mask].abs().max().item()
        assert diff < 1e-4, f"sampled log-probs: vLLM vs learner differ by {diff}"

        # Score sample 0 in each engine and in the learner: raw log-probs, the same weights.
        prompt, response = rollouts.prompt_ids[0], rollouts.response_ids[0]
        raw = ray.get(roles.learner.call(0, Learner.logprobs, batch.sequences.select(slice(0, 1)), 1.0))
        raw = raw[0, : len(response)]
        for i in range(len(roles.rollout)):
            (engine_lp,) = ray.get(roles.rollout.call(i, RolloutWorker.score, [prompt + response], len(prompt)))
            diff = (torch.tensor(engine_lp) - raw).abs().max().item()
            assert diff < 1e-4, f"rollout actor {i}: vLLM vs learner log-probs differ by {diff}"

    def test_each_engine_proves_it_serves_learner_0s_weights(self, two_by_two):
        """The fingerprint read through vLLM's own kernels (oneDNN-packed on CPU) equals learner 0's after a push,
        and a fingerprint of other weights is refused, naming the engine and the tensor."""
        cfg, roles = two_by_two
        roles.sync.push(version=8)  # verify_weights is on: the push itself checks every engine
        expected = ray.get(roles.learner.call(0, Learner.weights_fingerprint, cfg.rollout.dtype))
        assert ray.get([roles.rollout.call(i, RolloutWorker.check_weights, 8, roles.rollout.name(i), expected)
                        for i in range(len(roles.rollout))]) == [8, 8]
        # Engine 1 loads weights with one row of a fused, oneDNN-packed projection changed: read through its
        # kernel, that tensor, and only it, differs from learner 0's.
        name = "model.layers.0.self_attn.k_proj.weight"
        changed = weights(roles, 0)
        changed[name][5] += 0.01
        assert ray.get(roles.rollout.call(1, RolloutWorker.load_weights, 9, [BucketParts.whole(changed)])) == 9
        with pytest.raises(WeightMismatch, match=rf"{re.escape(roles.rollout.name(1))} serves weights other than "
                                                 rf"the learners' after loading version 9: {re.escape(name)} differs "
                                                 rf".*; 1 of \d+ tensors differ"):
            ray.get(roles.rollout.call(1, RolloutWorker.check_weights, 9, roles.rollout.name(1), expected))
        roles.sync.push(version=10)  # learner 0's weights again, verified

    def test_raising_reward_names_function_and_sample(self, two_by_two):
        cfg, roles = two_by_two
        tokenizer = load_tokenizer(cfg.model)
        prompts, _ = load_prompts(cfg.data, tokenizer)
        reward = cfg.reward.model_copy(update={"function": "tests.e2e.faulty_rewards:always_raises"})
        with pytest.raises(RewardError) as err:
            generate_and_score(roles, prompts[:2], reward)
        assert "tests.e2e.faulty_rewards:always_raises" in str(err.value)
        assert "sample" in str(err.value).lower()
        assert "faulty_rewards.py" in str(err.value)  # the user's own failing line, from the remote traceback

        # on_error zero scores failures 0, but a step in which most samples fail stops the run with the last error.
        zero = reward.model_copy(update={"on_error": "zero"})
        with pytest.raises(RewardError, match=r"samples scored for step 1 failed .* The last failure: reward function "
                                              r"tests\.e2e\.faulty_rewards:always_raises failed on sample"):
            generate_and_score(roles, prompts[:2], zero)
        tolerant = zero.model_copy(update={"max_error_frac": 1.0})
        scored = generate_and_score(roles, prompts[:2], tolerant)
        assert scored.rewards == [0.0] * len(scored)


    def test_a_reward_task_whose_worker_dies_is_retried(self, two_by_two, tmp_path):
        cfg, roles = two_by_two
        prompts, _ = load_prompts(cfg.data, load_tokenizer(cfg.model))
        reward = cfg.reward.model_copy(update={"function": "tests.e2e.faulty_rewards:dies_once"})

        def marked(name: str) -> list:
            return [replace(p, sample={**p.sample, "marker": str(tmp_path / name)}) for p in prompts[:2]]

        # The reward task's process exits on its first call: without retries the step fails with Ray's error.
        with pytest.raises(ray.exceptions.WorkerCrashedError):
            generate_and_score(roles, marked("no-retry"), reward.model_copy(update={"max_retries": 0}))
        scored = generate_and_score(roles, marked("retried"), reward)  # max_retries 3 by default
        assert (tmp_path / "retried").exists()  # it did die once
        assert scored.rewards == [1.0] * len(scored)  # every sample scored, none as a failure


# 1 rollout actor x 1 learner is the quickstart (test_quickstart.py). Each topology also runs other options end
# to end: KL in the reward (old-policy vs reference log-probs) with whitened Dr. GRPO advantages; bypass mode (vLLM's
# log-probs as the old policy) with two mini-batches per step; GSPO with ICEPop on a bf16 engine (a real
# rollout/trainer mismatch) with FSDP-sharded learners forming micro-batches by a token budget; a stop string (vLLM
# then detokenizes while sampling); two FSDP learners sharing every micro-batch (sequence parallelism), and two
# reference actors sharing theirs.
TOPOLOGIES = {
    "2x1-kl_in_reward": (2, 1, ["loss.kl.target=reward", "loss.kl.estimator=k1", "algorithm.advantage=dr_grpo",
                                "algorithm.whitening=true", "learner.warmup_steps=0",
                                "rollout.sampling.stop=['9']"]),
    "1x2-bypass-2_mini_batches": (1, 2, ["algorithm.old_logprobs=rollout", "loss.correction=null",
                                         "learner.mini_batch_size=16", "learner.micro_batch_size=4"]),
    "2x2-gspo-icepop-fsdp": (2, 2, ["loss.policy=gspo", "loss.correction.mode=icepop", "loss.correction.low=0.5",
                                    "rollout.dtype=bfloat16", "learner.strategy=fsdp",
                                    "learner.max_tokens_per_micro_batch=48"]),
    "1x2-sequence_parallel-fsdp": (1, 2, ["learner.strategy=fsdp", "learner.sequence_parallel_size=2",
                                          "reference.sequence_parallel_size=2", "cluster.reference.num_actors=2",
                                          "cluster.reference.num_cpus=0.25"]),
}


def topology(tmp_path, name: str, *more: str) -> Config:
    """The config of topology `name` (TOPOLOGIES), writing into tmp_path, with `more` settings."""
    rollout_actors, learners, options = TOPOLOGIES[name]
    return quickstart(tmp_path, f"cluster.rollout.num_actors={rollout_actors}",
                      f"cluster.learner.num_actors={learners}", "cluster.learner.num_cpus=0.25", "run.steps=2",
                      "rollout.prompts_per_step=4", "learner.micro_batch_size=8", "run.checkpoint_every=1", *options,
                      *more)


# The 2x2 topology runs on several nodes, and on one, in tests/e2e/test_nodes.py.
@pytest.mark.parametrize("name", [name for name in TOPOLOGIES if name != "2x2-gspo-icepop-fsdp"])
def test_topologies_train_end_to_end(ray_session, tmp_path, name):
    cfg = topology(tmp_path, name)
    check_topology(cfg, train(cfg), tmp_path)


def check_topology(cfg: Config, history: list[dict], tmp_path: Path) -> None:
    """What every topology's run must show, whatever its options."""
    assert [h["policy_version"] for h in history] == [0, 1]  # weights that sampled each step
    assert all(h["learner/optimizer_steps"] >= 1 for h in history)
    # Also where the learners took the old log-probs from the update itself (2x2: one optimizer step per step).
    assert all("correction/mismatch_kl/staleness_0" in h for h in history)
    # Each response token counted once, however many learners held it (sequence-parallel learners share theirs).
    for h in history:
        assert h["learner/tokens"] == pytest.approx(h["response_length/mean"] * cfg.global_batch_size)
    run_dir = tmp_path / cfg.run.name
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 2
    assert (run_dir / "checkpoints" / "step_000002" / "policy" / "model" / "config.json").exists()
    # Step 1's checkpoint is written after step 1's row: its time shows in step 2's.
    assert "time/checkpoint" not in history[0] and history[1]["time/checkpoint"] > 0
    if cfg.loss.kl.target == "reward":
        # Step 1 samples from the initial policy, which is the reference: the old-policy KL is exactly 0 (vLLM's
        # bf16 log-probs would have put the rollout/trainer mismatch here). Step 2's policy has moved (no warm-up, whose
        # first step has lr 0 as in transformers' schedules).
        assert abs(history[0]["kl/in_reward"]) < 1e-6 and abs(history[1]["kl/in_reward"]) > 1e-4
        assert history[1]["loss/kl"] == 0  # not also in the loss
    if cfg.reference.sequence_parallel_size > 1:
        # Step 1's one optimizer step starts from the reference: the KL to the split reference's log-probs is 0
        # (rows out of order, or a slice scored twice, would show here).
        assert abs(history[0]["kl/ref"]) < 1e-6
    if cfg.rollout.dtype == "bfloat16":  # against the fp32 learner: a mismatch the correction sees
        # (fp32 engines: |mismatch_kl| ~2e-8; bf16 ones: ~1e-4)
        assert max(abs(h["correction/mismatch_kl"]) for h in history) > 1e-6
    if cfg.learner.strategy.type == "fsdp":  # every learner wrote its shards; learner 0 the gathered HF policy
        assert len(list((run_dir / "checkpoints" / "step_000002" / "policy" / "shards").glob("shard-*"))) == 2
    if cfg.learner.mini_batch_size:
        assert history[-1]["learner/optimizer_steps"] == 2 * cfg.global_batch_size // cfg.mini_batch_size


def test_step_metrics_reach_the_nodes_prometheus_endpoint(ray_session):
    """What the dashboard's metrics view (and Prometheus) reads: the node's metrics export endpoint."""
    import time
    import urllib.request

    from distrl.metrics import RayMetricsSink

    sink = RayMetricsSink("metrics-probe")
    here = ray.get_runtime_context().get_node_id()  # the driver's node, whose agent exports its metrics
    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["NodeID"] == here)
    deadline, found = time.monotonic() + 60, []
    while not found and time.monotonic() < deadline:
        sink.write(3, {"reward/mean": 0.42, "kl/ref": None})  # exported periodically (about every 10 s)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        found = [line for line in text.splitlines()
                 if line.startswith("ray_distrl_reward_mean{") and 'run="metrics-probe"' in line]
        time.sleep(1)
    assert found and found[0].endswith(" 0.42")
