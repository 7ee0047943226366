"""`distrl eval` on a real vLLM engine: a checkpoint of a short run evaluated on a held-out set without training,
every sample written with its reward, the figures equal to the estimators recomputed from those samples; and the
errors for what cannot be evaluated."""

import json
from pathlib import Path

from distrl.cli import main
from distrl.driver import train
from tests.hf_rollout import HFRolloutWorker
from tests.test_driver_local import ROOT, local_config
from tests.test_evaluation import recomputed

TOY = ROOT / "configs" / "data" / "toy.jsonl"


def test_a_checkpoint_is_evaluated_without_training(tmp_path, tiny_model_dir, capsys):
    cfg = local_config(tmp_path, tiny_model_dir, "rollout.dtype=float32", "run.steps=2", "run.checkpoint_every=2")
    train(cfg, rollout_worker=HFRolloutWorker)
    capsys.readouterr()  # the run's own output
    step = tmp_path / cfg.run.name / "checkpoints" / "step_000002"
    sets = f'eval.sets=[{{"name": "toy", "path": "{TOY}", "limit": 6}}]'
    # The run's own settings: its directory holds the run (no overwrite), which evaluation leaves alone.
    args = ["eval", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--set", f"model.path={tiny_model_dir}",
            "--set", f"run.output_dir={tmp_path}", "--set", "run.overwrite=false", "--set", "eval.sampling.n=4",
            "--set", "eval.sampling.temperature=1.0", "--set", sets, "--checkpoint", str(step)]
    assert main(args) == 0
    out = capsys.readouterr().out
    printed = json.loads(out[out.rindex("{\n"):])  # after vLLM's own lines, when it was imported before
    written = json.loads((step / "eval" / "figures.json").read_text())
    assert printed == written and written["policy_version"] == 2 and written["eval/toy/samples"] == 24.0
    assert written["eval/toy/policy_version"] == 2.0
    samples = [json.loads(line) for line in (step / "eval" / "toy.jsonl").read_text().splitlines()]
    assert len(samples) == 24 and {"prompt", "completion", "reward", "answer", "info"} <= set(samples[0])
    for key, value in recomputed(step / "eval" / "toy.jsonl", 4).items():
        assert abs(written[f"eval/toy/{key}"] - value) < 1e-12


def test_what_cannot_be_evaluated_is_named(tmp_path, tiny_model_dir, capsys):
    base = ["eval", "--config", str(ROOT / "configs" / "quickstart.yaml"), "--set", f"model.path={tiny_model_dir}",
            "--set", f"run.output_dir={tmp_path}"]
    assert main([*base, "--set", "eval=null"]) == 2
    assert "the config has no eval section" in capsys.readouterr().err
    sets = f'eval.sets=[{{"name": "toy", "path": "{TOY}"}}]'
    assert main([*base, "--set", sets, "--checkpoint", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert f"--checkpoint {tmp_path / 'nowhere'}: no policy model at" in err
    assert main([*base, "--set", sets, "--output", str(tmp_path / "out")]) == 0  # the config's own model
    assert (Path(tmp_path) / "out" / "toy.jsonl").is_file()
