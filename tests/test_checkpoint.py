"""State dicts survive the checkpoint format (safetensors + JSON) exactly, and what it cannot hold without pickle
is refused when saving rather than lost."""

import math

import pytest
import torch

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
