"""State dicts survive the checkpoint format (safetensors + JSON) exactly, and what it cannot hold without pickle
is refused when saving rather than lost. A checkpoint is complete or refused: its manifest names a missing,
truncated or altered file, resume falls back to the newest complete one, and pruning keeps the newest K."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from distrl import checkpoint
from distrl.checkpoint import latest, load_state, path_for, save_state


def test_state_round_trips_with_its_types(tmp_path):
    state = {
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.arange(6.0).reshape(2, 3)},
                                 7: {"step": torch.tensor(1.0), "exp_avg": torch.ones(2, dtype=torch.bfloat16)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "foreach": None, "params": [0, 7]}]},
        "scheduler": {"base_lrs": [1e-3], "_last_lr": [float("inf")], "lr_lambdas": [{}], "last_epoch": 4},
        "name": "x", "flag": True, "empty": {},
    }
    save_state(state, tmp_path, "s")
    loaded = load_state(tmp_path, "s")
    exp_avg = loaded["optimizer"]["state"][7]["exp_avg"]
    assert exp_avg.dtype == torch.bfloat16 and torch.equal(exp_avg, state["optimizer"]["state"][7]["exp_avg"])
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], torch.arange(6.0).reshape(2, 3))
    assert loaded["optimizer"]["state"][0]["step"].shape == ()
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]  # tuple stays a tuple
    assert loaded["scheduler"] == state["scheduler"] and math.isinf(loaded["scheduler"]["_last_lr"][0])
    assert (loaded["name"], loaded["flag"], loaded["empty"]) == ("x", True, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "s.safetensors"]


@pytest.mark.parametrize("state,message", [
    ({"fn": print}, "fn: a builtin_function_or_method cannot be saved without pickle"),
    ({"x": {1: 1, "a": 2}}, "x: a dict's keys must be all strings or all integers"),
    ({"x": {"__tensor__": "y"}}, "reserved"),
    ({"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}}, "same key 'a.b'"),
])
def test_what_needs_pickle_is_refused(tmp_path, state, message):
    with pytest.raises(TypeError, match=message):
        save_state(state, tmp_path, "s")


def test_latest_ignores_an_interrupted_save(tmp_path):
    assert latest(tmp_path) is None
    path_for(tmp_path, 2).mkdir(parents=True)
    path_for(tmp_path, 10).mkdir()
    path_for(tmp_path, 12).with_name("step_000012.tmp").mkdir()
    assert latest(tmp_path) == path_for(tmp_path, 10)


class WeightsOnly:
    """Stands in for an HF model: `save_pretrained` writes one safetensors file."""

    def save_pretrained(self, directory: Path, safe_serialization: bool) -> None:
        from safetensors.torch import save_file

        directory.mkdir()
        save_file({"w": torch.arange(64.0)}, directory / "model.safetensors")


def saved(run_dir: Path, step: int) -> Path:
    state = {"optimizer": {"state": {0: {"exp_avg": torch.ones(8)}}}, "optimizer_steps": step}
    return checkpoint.write(path_for(run_dir, step), {"policy": (WeightsOnly(), state)}, {"step": step})


def test_a_written_checkpoint_lists_every_file_with_its_size_and_checksum(tmp_path):
    path = saved(tmp_path, 3)
    files = json.loads((path / "manifest.json").read_text())["files"]
    assert sorted(files) == ["driver_state.json", "policy/model/model.safetensors", "policy/trainer_state.json",
                             "policy/trainer_state.safetensors"]
    assert files["driver_state.json"]["bytes"] == len('{"step": 3}')
    assert checkpoint.problem(path) is None
    assert checkpoint.load_trainer_state(path / "policy")["optimizer_steps"] == 3
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


def _truncate(path: Path) -> None:
    file = path / "policy" / "model" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-10])


def _flip_a_byte(path: Path) -> None:
    file = path / "policy" / "trainer_state.safetensors"
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,message,seen_without_checksums", [
    (_truncate, r"policy/model/model\.safetensors has \d+ bytes, the manifest says \d+ \(truncated\?\)", True),
    (_flip_a_byte, r"policy/trainer_state\.safetensors does not match its SHA-256", False),
    (lambda p: (p / "driver_state.json").unlink(), r"driver_state\.json is missing", True),
    (lambda p: (p / "manifest.json").unlink(), r"has no manifest\.json: it was not completely written", True),
    (lambda p: (p / "manifest.json").write_text("{"), r"manifest\.json is damaged", True),
])
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path, damage, message, seen_without_checksums):
    path = saved(tmp_path, 1)
    damage(path)
    why = checkpoint.problem(path)
    assert why is not None and re.search(message, why), why
    # Learners check sizes only (the driver read the checksums when it chose the checkpoint).
    assert (checkpoint.problem(path, checksums=False) is not None) == seen_without_checksums
    if seen_without_checksums:
        with pytest.raises(RuntimeError, match="step_000001"):
            checkpoint.load_trainer_state(path / "policy")


def test_a_part_that_was_not_written_fails_the_checkpoint_and_an_older_format_is_named(tmp_path):
    tmp = checkpoint.begin(path_for(tmp_path, 1))
    written = checkpoint.write_trainer(tmp / "policy", None, {"optimizer_steps": 1})
    with pytest.raises(RuntimeError, match=r"critic/trainer_state\.json was not written"):
        checkpoint.finish(tmp, {"step": 1}, {"policy": [written], "critic": [{}]})
    assert checkpoint.latest(tmp_path) is None  # still only the temporary directory
    old = path_for(tmp_path, 2)
    old.mkdir(parents=True)
    (old / "manifest.json").write_text(json.dumps({"format": 1, "files": {}}))
    assert "written by an older distrl" in checkpoint.problem(old)


def test_resume_falls_back_to_the_newest_complete_checkpoint_and_sets_the_damaged_aside(tmp_path):
    for step in (2, 4, 6):
        saved(tmp_path, step)
    _flip_a_byte(path_for(tmp_path, 6))
    found, refused = checkpoint.resume_point(tmp_path)
    assert found == path_for(tmp_path, 4)
    assert len(refused) == 1 and "step_000006" in refused[0] and "SHA-256" in refused[0]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_000002", "step_000004", "step_000006.damaged"]
    assert checkpoint.latest(tmp_path) == path_for(tmp_path, 4)  # a later save of step 6 is not confused with it


def test_prune_keeps_the_newest_k_and_clears_interrupted_saves(tmp_path):
    for step in (1, 2, 3):
        saved(tmp_path, step)
    path_for(tmp_path, 4).with_name("step_000004.tmp").mkdir()
    deleted = checkpoint.prune(tmp_path, keep=2)
    assert [p.name for p in deleted] == ["step_000001", "step_000004.tmp"]
    assert checkpoint.all_checkpoints(tmp_path) == [path_for(tmp_path, 2), path_for(tmp_path, 3)]
    assert checkpoint.prune(tmp_path, keep=None) == []


def test_checkpoints_are_ordered_by_step_not_by_name(tmp_path):
    saved(tmp_path, 999_999)
    saved(tmp_path, 1_000_000)  # step_1000000 sorts before step_999999 as text
    assert checkpoint.latest(tmp_path) == path_for(tmp_path, 1_000_000)
    assert checkpoint.prune(tmp_path, keep=1) == [path_for(tmp_path, 999_999)]


def test_a_step_damaged_twice_is_set_aside_twice(tmp_path):
    saved(tmp_path, 1)
    for _ in range(2):
        saved(tmp_path, 2)
        _flip_a_byte(path_for(tmp_path, 2))
        assert checkpoint.resume_point(tmp_path)[0] == path_for(tmp_path, 1)
    aside = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if "damaged" in p.name)
    assert len(aside) == 2 and aside[0] == "step_000002.damaged"
