"""The asynchronous loop for real (Ray actors, vLLM CPU engines, transformers learners): the async quickstart
learns with its engine on another node than the learner and reference; no trained sample is staler than
`loop.max_staleness` in either scaling direction (2 rollout actors x 1 learner with dynamic sampling, which fills
batches with groups that carry a signal, and partial rollouts, whose samples go on across weight pushes; 1 x 2 cut
and resumed with partial rollouts, which continues where its checkpoint left off, each prompt trained once).

Each run carries several checks: starting one costs more than all its steps."""

import json

from distrl.driver import train

from .conftest import quickstart
from .faults import check_each_prompt_trained_once
from .nodes import actors_of


def rows(tmp_path, name: str = "quickstart") -> list[dict]:
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_async_quickstart_learns_within_the_bound_on_two_nodes(ray_session, tmp_path):
    history = train(quickstart(tmp_path, "loop.mode=async", "loop.max_staleness=1", "run.name=async-nodes",
                               "cluster.rollout.labels={pool: inference}", "cluster.learner.labels={pool: head}",
                               "cluster.reference.labels={pool: head}"))
    assert len(history) == 30
    # staleness/max is the largest (update version - generating version) over the batch's samples
    assert max(h["staleness/max"] for h in history) == 1
    assert sum(h["samples/dropped_stale"] for h in history) == 0  # admission by capacity left nothing to drop
    first = sum(h["reward/mean"] for h in history[:5]) / 5
    last = sum(h["reward/mean"] for h in history[-5:]) / 5
    assert last > first + 0.15, f"did not learn: first 5 steps {first:.3f}, last 5 steps {last:.3f}"
    assert all(h["correction/weight_mean"] is not None for h in history)
    nodes = {name.rsplit("/", 1)[1]: a["node_id"] for name, a in actors_of("async-nodes").items()}
    assert nodes["rollout-0"] == ray_session.named["inference"].node_id != nodes["learner-0"]


def test_two_engines_one_learner_partial_rollouts_within_the_bound_with_dynamic_sampling(ray_session, tmp_path):
    cfg = quickstart(tmp_path, "loop.mode=async", "loop.max_staleness=2", "run.steps=6",
                     "loop.partial_rollouts=true", "loop.slice_tokens=4",
                     "cluster.rollout.num_actors=2", "cluster.learner.num_cpus=0.25", "rollout.prompts_per_step=4",
                     "rollout.chunk_prompts=1", "learner.micro_batch_size=8",
                     "reward.function=tests.binary_rewards:has_digit", "rollout.dynamic_sampling.max_rounds=20")
    history = train(cfg)
    assert [r["step"] for r in rows(tmp_path)] == list(range(1, 7))
    assert all(h["staleness/max"] <= 2 for h in history)
    assert any(h["staleness/max"] > 0 for h in history)  # the producers really ran ahead
    assert all(h["learner/tokens"] > 0 for h in history)
    # Dynamic sampling: groups whose rewards are all equal were filtered, and every batch filled without the cap.
    assert sum(h["dynamic_sampling/filtered_groups"] for h in history) > 0
    assert all(h["dynamic_sampling/cap_reached"] == 0 for h in history)
    assert all(h["reward/std"] > 0 for h in history)
    # Partial rollouts: samples of up to 16 tokens drawn 4 at a time; some went on under weights pushed meanwhile,
    # each token stamped with its own version, and none waited so long that it was dropped.
    assert any(h["partial/carried_tokens"] > 0 for h in history)
    assert any(h["tokens/versions_spanned_max"] > 1 for h in history)
    assert sum(h["samples/dropped_stale"] for h in history) == 0


def test_one_engine_two_learners_within_the_bound_cut_and_resumed(ray_session, tmp_path):
    common = ("loop.mode=async", "loop.max_staleness=2", "cluster.learner.num_actors=2",
              "cluster.learner.num_cpus=0.25", "rollout.prompts_per_step=4", "rollout.chunk_prompts=1",
              "learner.micro_batch_size=8", "run.checkpoint_every=2",
              "loop.partial_rollouts=true", "loop.slice_tokens=4", "run.samples_every=1", "run.samples_per_write=32")
    first = train(quickstart(tmp_path, *common, "run.steps=3", "run.checkpoint_at_end=false"))  # 3: trained, not saved
    resumed = train(quickstart(tmp_path, *common, "run.steps=6", "run.resume=true", "run.overwrite=false"))
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 3, 4, 5, 6]
    history = first + resumed
    assert all(h["staleness/max"] <= 2 for h in history)
    assert any(h["staleness/max"] > 0 for h in history)  # the producer really ran ahead
    assert all(h["learner/tokens"] > 0 for h in history)
    assert resumed[0]["learner/optimizer_steps"] == 3  # the optimizer state came back with step 2's checkpoint
    state = json.loads((tmp_path / "quickstart" / "checkpoints" / "step_000004" / "driver_state.json").read_text())
    # 4 steps x 4 prompts consumed, none twice. Not necessarily tickets 0..15: a chunk whose rewards are still being
    # scored when the batch is cut is trained a step later than younger chunks (the local-mode test checks the
    # exact tickets).
    assert state["data"]["next"] + len(state["data"]["consumed"]) == 16
    # Partial rollouts: each prompt trained once over the six steps, with its 8 samples, none lost. Whether samples
    # are open at the cut depends on the speeds (with the learners slower than the engine the next step's groups
    # have finished when a batch is handed out), so carried samples are asserted in the runs with faults
    # (test_nodes.py), not here; step 2's checkpoint holds no partial samples either way, the resumed run samples
    # open groups again from their prompts.
    assert sum(h["samples/dropped_stale"] for h in history) == 0
    check_each_prompt_trained_once(tmp_path / "quickstart", 6, n=8, k=2)
