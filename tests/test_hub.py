"""Hub names resolved through the Hugging Face cache offline (`distrl.hub`), as every role resolves `model.path`: the
tokenizer, the replicated and the FSDP-sharded learner read the snapshot a hub name points at; an uncached name fails
with one line that says where it looked and how to download it. The cache is written in the hub's own layout
(`tests/hub_cache.py`), since no test can reach the hub."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_sharding import _spawn

from distrl.config import FSDPStrategy, ModelConfig
from distrl.hub import HubError, is_hub_name, local_dir, offline
from distrl.workers.model_files import load_tokenizer, resolve_model_path, tokenizer_path
from distrl.workers.training.model import load_causal_lm
from tests.hub_cache import cache_gsm8k_like, cache_model, cache_repo

NAME = "distrl-tests/tiny-llama"


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An offline hub cache of the test's own (`$HF_HOME/hub`); spawned processes inherit the environment."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


def test_what_is_a_hub_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "artifacts").mkdir()
    assert is_hub_name("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_name("gpt2") and is_hub_name("openai/gsm8k")
    assert not is_hub_name("artifacts/model")  # its namespace is a local directory: a missing local path
    assert not is_hub_name("./model") and not is_hub_name("/abs/model") and not is_hub_name("a/b/c")
    assert not is_hub_name("~/model") and not is_hub_name("train.jsonl", (".jsonl",))
    assert local_dir("artifacts/model") == "artifacts/model"  # not a name: the loader reports the missing path


def test_the_offline_switches(monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    assert not offline("model") and not offline("dataset")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert offline("dataset") and not offline("model")  # datasets' own switch is for data sets
    monkeypatch.setenv("HF_HUB_OFFLINE", "true")
    assert offline("model")


def test_every_loader_reads_the_snapshot_a_hub_name_points_at(hub, tiny_model_dir):
    snapshot = cache_model(hub, NAME, tiny_model_dir)
    cfg = ModelConfig(path=NAME)
    assert resolve_model_path(cfg) == str(snapshot) == tokenizer_path(cfg)
    assert load_tokenizer(cfg).get_vocab() == load_tokenizer(ModelConfig(path=str(tiny_model_dir))).get_vocab()
    model = load_causal_lm(cfg, "float32")
    local = load_causal_lm(ModelConfig(path=str(tiny_model_dir)), "float32")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), local.state_dict().values(), strict=True))


def test_a_cache_with_only_the_tokenizer_files_serves_the_tokenizer(hub, tiny_model_dir):
    files = {p.name: p.read_bytes() for p in tiny_model_dir.iterdir() if not p.name.endswith(".safetensors")}
    snapshot = cache_repo(hub, "model", NAME, files)
    assert local_dir(NAME, weights=False) == str(snapshot)


@pytest.mark.parametrize("revision", [None, "v1"])
def test_an_uncached_model_offline_is_one_line_saying_where_and_how(hub, revision):
    with pytest.raises(HubError) as err:
        local_dir("someone/absent", revision=revision)
    message = str(err.value)
    assert "\n" not in message and message.startswith("someone/absent is no local path")
    assert f"not in the Hugging Face cache {hub} and HF_HUB_OFFLINE is set" in message
    assert f"`hf download someone/absent{' --revision v1' if revision else ''}`" in message


def fsdp_scenario(rank: int, world: int, port: int, model_dir: Path, out: Path) -> dict:
    """A sharded learner (FSDP over a 1-process gloo group) built from the hub name `NAME`: its full weights."""
    from test_learner import make_learner
    from test_learner_fsdp import full_weights

    learner = make_learner(NAME, strategy=FSDPStrategy())
    learner.connect("127.0.0.1", port, rank, world)
    return {**full_weights(learner)}  # a plain dict: the bucket type does not load with weights_only


def test_an_fsdp_learner_reads_a_hub_name_from_the_cache(hub, tiny_model_dir, tmp_path):
    cache_model(hub, NAME, tiny_model_dir)  # FSDP's reader lists a local directory: it gets the snapshot's
    weights = _spawn("test_hub:fsdp_scenario", tiny_model_dir, tmp_path, world=1)
    local = load_causal_lm(ModelConfig(path=str(tiny_model_dir)), "float32").state_dict()
    assert weights and set(weights) <= set(local)
    assert all(torch.equal(weights[k], local[k]) for k in weights)


TRAIN_ONE_STEP = """
import json, sys
from distrl import config
from distrl.driver import train
from tests.hf_rollout import HFRolloutWorker

cfg = config.load("configs/quickstart.yaml", sys.argv[1:])
print(json.dumps(train(cfg, rollout_worker=HFRolloutWorker)))
"""


def test_one_step_trains_from_a_hub_named_data_set_and_model_resolved_offline(tiny_model_dir, tmp_path):
    """The whole run in a fresh process whose environment a user on an air-gapped cluster would set: HF_HOME at a
    cache that holds both names, both offline switches on (nothing else could resolve them: the hub is out of
    reach, and neither name is a local path)."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    cache_model(tmp_path / "hf" / "hub", NAME, tiny_model_dir)
    cache_gsm8k_like(tmp_path / "hf" / "hub", train=16)
    overrides = [f"model.path={NAME}", "model.create_tiny_if_missing=false", "data.path=openai/gsm8k",
                 "data.subset=main", "data.split=train", "data.prompt={question}\nAnswer after ####.",
                 "data.max_prompt_tokens=128", "reward.function=tests.hub_cache:gsm8k_reward", "eval=null",
                 f"run.output_dir={tmp_path / 'runs'}", "run.steps=1", "run.progress=false", "run.ray_metrics=false",
                 "run.tensorboard=false", "cluster.backend=local", "rollout.prompts_per_step=4",
                 "rollout.n_samples_per_prompt=2", "rollout.sampling.max_new_tokens=6", "learner.micro_batch_size=8"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(root),
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", TRAIN_ONE_STEP, *overrides], cwd=root, env=env, check=False,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (history,) = json.loads(done.stdout.strip().splitlines()[-1])
    metrics = tmp_path / "runs" / "quickstart" / "metrics.jsonl"
    (step,) = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert step["step"] == 1 and history["learner/tokens"] > 0 and history["reward/errors"] == 0
    state = json.loads((tmp_path / "runs" / "quickstart" / "checkpoints" / "step_000001" / "driver_state.json")
                       .read_text())
    assert state["data"]["num_prompts"] == 16  # the train split of `main`, not `test` (2 rows)
