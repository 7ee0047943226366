"""The reasoning-gym example's pieces (examples/reasoning_gym, configs/reasoning-gym.yaml): its sets (the held-out
seeds apart from the warm start's and GRPO's), its warm-start examples (token for token the prompt distrl makes
of the row; the generator's answer or the words unreversed, between the scorer's tags), a few warm-start steps and
the evaluation; and the example's path through distrl's loop with the real package: the config's `data.function`
rows scored by its `reward.function` (the task's own scorer), with its held-out set, trained on the local backend
with an HF-sampling rollout worker."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from distrl import config
from distrl.data.prompts import load_prompts
from distrl.standards.checks import held_out_problems

pytest.importorskip("reasoning_gym")

# After the skip: the example's modules score with reasoning-gym.
from distrl.standards import reasoning_gym
from examples.reasoning_gym.evaluate import evaluate
from examples.reasoning_gym.run import CONFIG, DEFAULT_WARM_START_STEPS, WARM_BATCH
from examples.reasoning_gym.warm_start import build_model, completion, encode, unreversed, warm_start

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cfg():
    return config.load(ROOT / CONFIG)


@pytest.fixture(scope="module")
def rows(cfg):
    return reasoning_gym.rows(**{**cfg.data.kwargs, "size": 400})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, rows):
    return build_model(tmp_path_factory.mktemp("reasoning_gym") / "base", rows[:200])


@pytest.fixture(scope="module")
def memorised(model_dir, rows, tmp_path_factory) -> Path:
    """The tiny model warm-started on the first 4 rows only, until it knows them by heart (both answers): on
    those rows it writes the generator's answer or the words unreversed, so rewards are 1 or less."""
    out = tmp_path_factory.mktemp("memorised") / "model"
    shutil.copytree(model_dir, out)
    losses = warm_start(out, rows[:4], steps=100, batch_size=16, lr=5e-3)
    assert losses[-1] < 1.0, losses[-1]
    return out


def test_the_held_out_questions_are_not_the_warm_starts_nor_grpos(cfg):
    held_out = reasoning_gym.rows(**cfg.eval.sets[0].kwargs)
    warm = reasoning_gym.rows(**{**cfg.data.kwargs, "size": DEFAULT_WARM_START_STEPS * WARM_BATCH})
    grpo = reasoning_gym.rows(**cfg.data.kwargs)
    sets = [s.model_dump(by_alias=True) for s in cfg.eval.sets]
    assert held_out_problems(cfg.data.model_dump(by_alias=True), sets) == []
    assert [r["prompt"] for r in grpo] == [r["prompt"] for r in warm[:len(grpo)]]  # GRPO's rows: the first
    # Seeds apart; yet 6 of the 200 held-out questions are three words the 80000 warm-start questions drew too.
    assert (reasoning_gym.overlap(warm, held_out), reasoning_gym.overlap(grpo, held_out)) == (6, 0)


def test_a_warm_start_example_is_what_a_rollout_holds(cfg, rows, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = cfg.data.model_copy(update={"kwargs": {**cfg.data.kwargs, "size": 5}})
    prompts, _ = load_prompts(data, tokenizer)
    for prompt, row in zip(prompts, rows[:5], strict=True):
        assert encode(tokenizer, row["prompt"], "")[0] == prompt.prompt_ids
    row = rows[0]
    _, ids = encode(tokenizer, row["prompt"], completion(row["answer"]))
    assert tokenizer.decode(ids[:-1]) == f"<answer>{row['answer']}</answer>" and ids[-1] == tokenizer.eos_token_id
    words = row["metadata"]["words"]
    assert row["answer"] == ", ".join(reversed(words)) and unreversed(row) == ", ".join(words)
    assert reasoning_gym.score(row["prompt"], completion(row["answer"]), row)["reward"] == 1.0
    assert reasoning_gym.score(row["prompt"], completion(unreversed(row)), row)["reward"] < 1.0


def test_a_few_warm_start_steps_lower_the_loss_and_the_evaluation_runs(rows, model_dir, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(model_dir, out)
    losses = warm_start(out, rows, steps=12, batch_size=8)
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    figures = evaluate(out, rows[:8], max_new_tokens=8)
    assert set(figures) == {"sampled", "greedy"}
    assert all(a.n == 8 and 0.0 <= a.exact <= a.score <= 1.0 for a in figures.values())


def test_the_example_trains_on_the_generators_rows_with_the_tasks_own_scorer(cfg, memorised, tmp_path):
    from distrl.driver import train
    from tests.hf_rollout import HFRolloutWorker

    raw = yaml.safe_load((ROOT / CONFIG).read_text())
    raw["model"]["path"] = str(memorised)
    raw["data"]["kwargs"]["size"] = 4  # the rows it memorised
    raw["eval"].update(every=None, sampling={"n": 2, "temperature": 1.0})
    raw["eval"]["sets"][0]["limit"] = 4
    raw["rollout"].update(prompts_per_step=4, n_samples_per_prompt=4)
    raw["learner"]["micro_batch_size"] = raw["reference"]["micro_batch_size"] = 16
    raw["cluster"]["backend"] = "local"
    raw["run"].update(output_dir=str(tmp_path), steps=2, progress=False, tensorboard=False, ray_metrics=False,
                      samples_every=1, samples_per_write=16)
    history = train(config.from_dict(raw), rollout_worker=HFRolloutWorker)
    assert len(history) == 2

    run = tmp_path / cfg.run.name
    by_question = {r["prompt"]: r for r in reasoning_gym.rows(**raw["data"]["kwargs"])}
    samples = [json.loads(line) for step in (1, 2)
               for line in (run / "samples" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    # Every reward is the task's scorer on the sample's completion (the prompt is the question alone).
    for s in samples:
        assert s["reward"] == reasoning_gym.score(s["prompt"], s["completion"], by_question[s["prompt"]])["reward"]
    assert len(samples) == 32 and any(s["reward"] == 1.0 for s in samples) and any(s["reward"] < 1.0 for s in samples)
    for h, step in zip(history, (1, 2), strict=True):
        assert h["reward/mean"] == pytest.approx(sum(s["reward"] for s in samples[16 * (step - 1):16 * step]) / 16)
    # The held-out set (its own seeds) evaluated at the end, scored the same way.
    held_out = {r["prompt"]: r for r in reasoning_gym.rows(**cfg.eval.sets[0].kwargs)}
    evaluated = [json.loads(line) for line in (run / "eval" / "held_out" / "step_000002.jsonl").read_text()
                 .splitlines()]
    assert len(evaluated) == 8 and history[-1]["eval/held_out/samples"] == 8.0
    for s in evaluated:
        assert s["reward"] == reasoning_gym.score(s["prompt"], s["completion"], held_out[s["prompt"]])["reward"]
    assert history[-1]["eval/held_out/accuracy"] == pytest.approx(sum(s["reward"] for s in evaluated) / 8)
