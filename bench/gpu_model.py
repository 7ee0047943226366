"""The models of bench/bench_gpu_step.py: Qwen2.5's shapes, written at random, their FLOPs per learner step (the
formula in bench_gpu_step's docstring) and the devices' bfloat16 peaks the MFU is against."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

_QWEN25 = dict(max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, use_sliding_window=False)
SHAPES = {
    "0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, **_QWEN25),
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, **_QWEN25),
    "3B": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
               intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True, **_QWEN25),
    "7B": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False, **_QWEN25),
}
"""Qwen2.5's config.json of each size, less what a random model does not need."""

QWEN25_05B = SHAPES["0.5B"]

PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.4),
    ("H100", 989.4),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.4),
    ("H800", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.1),
    ("L4", 121.0),
)
"""Dense (no sparsity) bfloat16 tensor-core peak in TFLOP/s by device name, from NVIDIA's data sheets; the first
entry whose key is in `torch.cuda.get_device_name()` applies (more specific names first)."""


def peak_tflops(device_name: str) -> float | None:
    """The dense bfloat16 peak of the device named `device_name` (`PEAK_BF16_TFLOPS`), None when not in the table."""
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in device_name), None)


@dataclass(frozen=True)
class StepFlops:
    """Model FLOPs of one learner step (forward + backward), by part."""

    dense: float
    head: float
    attention: float

    @property
    def total(self) -> float:
        return self.dense + self.head + self.attention


def step_flops(config: dict, layer_params: int, lengths: list[int], response_tokens: int) -> StepFlops:
    """FLOPs of one step (the module docstring's formula) on sequences of `lengths` tokens, `response_tokens` of
    which are predicted, for a model of `config` whose decoder layers hold `layer_params` parameters."""
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    return StepFlops(dense=6.0 * layer_params * sum(lengths), head=6.0 * hidden * vocab * response_tokens,
                     attention=6.0 * layers * hidden * sum(s * s for s in lengths))


def write_model(directory: Path, config: dict | None = None) -> tuple[int, int]:
    """A random Qwen2 of `config`'s shape (default Qwen2.5-0.5B's) in `directory` (bfloat16 safetensors), made on
    the GPU when there is one (fast for 7B); returns (all parameters, parameters of the decoder layers)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**(config or QWEN25_05B))).to(torch.bfloat16)
    model.save_pretrained(directory)
    total = sum(p.numel() for p in model.parameters())
    layers = sum(p.numel() for p in model.model.layers.parameters())
    del model
    return total, layers
