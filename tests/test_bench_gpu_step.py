"""The arithmetic of bench/bench_gpu_step.py, on the CPU: the model has Qwen2.5-0.5B's size, the FLOP count follows
its formula, and device names find their bfloat16 peak (the specific H100 variants before the SXM entry)."""

from __future__ import annotations

import pytest
import torch
from gpu.test_gpu_bench import load_bench


def test_the_benchmarks_model_has_qwen25_05bs_parameter_count():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    bench = load_bench()
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**bench.SHAPES["0.5B"]))
    assert sum(p.numel() for p in model.parameters()) == 494_032_768  # Qwen2.5-0.5B's, tied head counted once
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize(("shape", "count"), [("1.5B", 1_543_714_304), ("3B", 3_085_938_688),
                                              ("7B", 7_615_616_512)])
def test_the_larger_shapes_have_qwen25s_parameter_counts(shape, count):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**load_bench().SHAPES[shape]))
    assert sum(p.numel() for p in model.parameters()) == count  # the published models' counts


def test_step_flops_count_layers_head_and_causal_attention():
    bench = load_bench()
    config = {"hidden_size": 4, "num_hidden_layers": 2, "vocab_size": 10}
    flops = bench.step_flops(config, layer_params=100, lengths=[3, 5], response_tokens=6)
    assert flops.dense == 6 * 100 * 8
    assert flops.head == 6 * 4 * 10 * 6
    assert flops.attention == 6 * 2 * 4 * (9 + 25)
    assert flops.total == flops.dense + flops.head + flops.attention


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.4), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L4", 121.0), ("NVIDIA L40S", 362.1),
    ("Tesla T4", None),
])
def test_the_peak_is_looked_up_from_the_device_name(name, peak):
    assert load_bench().peak_tflops(name) == peak
