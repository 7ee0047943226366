"""Learner-step throughput on one CUDA GPU: tokens/s, peak memory and MFU of `Learner.update` (replicated, bfloat16
autocast over float32 master weights, packed attention) for a randomly initialised Qwen2 of Qwen2.5-0.5B's shape
(hidden 896, 24 layers, 14 query and 2 key/value heads, MLP 4864, vocabulary 151936, tied embeddings: 494M
parameters). Needs torch (CUDA) and transformers only; no hub (the model is written locally at random).

    python bench/bench_gpu_step.py [--seqs 16] [--prompt 256] [--response 768] [--micro 4] [--steps 5]
                                   [--checkpointing] [--fsdp]

Each step is one optimizer step on `--seqs` sequences of `--prompt` + `--response` tokens (one mini-batch, one PPO
epoch, micro-batches of `--micro` sequences packed into one row each). Two steps warm up; the next `--steps` are
timed with the device synchronised around each.

MFU counts model FLOPs (the recompute of gradient checkpointing excluded), forward plus backward = 3 x forward:
  - 6 * N * tokens, N the parameters of the decoder layers (embedding lookups are not matmuls);
  - 6 * hidden * vocab * K for the LM head, K the positions whose logits are made (distrl makes them only where a
    response token is predicted: K = response tokens);
  - attention scores and values, causal: 6 * layers * hidden * s^2 per sequence of s tokens (the usual
    12 * layers * hidden * s per token, halved by the causal mask);
against the device's dense bfloat16 peak (`PEAK_BF16_TFLOPS`, looked up from the device name; none for a device
the table lacks, and no MFU then).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, use_sliding_window=False)
"""Qwen2.5-0.5B's config.json, less what a random model does not need."""

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


def write_model(directory: Path) -> tuple[int, int]:
    """A random Qwen2 of `QWEN25_05B`'s shape in `directory` (bfloat16 safetensors); returns (all parameters,
    parameters of the decoder layers)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B))
    model.to(torch.bfloat16).save_pretrained(directory)
    total = sum(p.numel() for p in model.parameters())
    layers = sum(p.numel() for p in model.model.layers.parameters())
    return total, layers


def make_batch(seqs: int, prompt: int, response: int, vocab: int):
    """`seqs` full-length sequences of random tokens, advantages of both signs, no old log-probs (one optimizer step
    takes its own, detached)."""
    from distrl.types.batches import Sequences, TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (seqs, prompt + response), generator=g)
    sequences = Sequences(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=torch.ones(seqs, response),
                          rollout_logprobs=torch.zeros(seqs, response),
                          policy_version=torch.zeros(seqs, dtype=torch.long),
                          response_versions=torch.zeros(seqs, response, dtype=torch.long))
    advantages = torch.linspace(-1, 1, seqs)[:, None].expand(seqs, response).contiguous()
    return TrainBatch(sequences, old_logprobs=None, advantages=advantages, ref_logprobs=None)


def run(seqs: int = 16, prompt: int = 256, response: int = 768, micro: int = 4, steps: int = 5,
        checkpointing: bool = False, fsdp: bool = False) -> dict[str, float | str | None]:
    """Time `steps` learner steps after two warm-up steps; returns the figures (also printed)."""
    from distrl.config import FSDPStrategy, LearnerConfig, LossConfig, ModelConfig, ReplicateStrategy
    from distrl.workers import dist
    from distrl.workers.learner import Learner

    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_step: CUDA is not available")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        total_params, layer_params = write_model(directory)
        cfg = LearnerConfig(dtype="bfloat16", micro_batch_size=micro, lr=1e-6, gradient_checkpointing=checkpointing,
                            strategy=FSDPStrategy() if fsdp else ReplicateStrategy())
        learner = Learner(ModelConfig(path=str(directory)), cfg, LossConfig(), temperature=1.0, norm_len=response,
                          mini_batch_size=seqs, total_optimizer_steps=steps + 2, seed=0, num_gpus=1)
        if fsdp:
            learner.connect("127.0.0.1", dist.free_port("127.0.0.1"), 0, 1)
        data = make_batch(seqs, prompt, response, QWEN25_05B["vocab_size"])
        try:
            for _ in range(2):
                learner.update(data)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                learner.update(data)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
        finally:
            if fsdp:
                learner.close()
    seconds = sorted(times)[len(times) // 2]
    tokens = seqs * (prompt + response)
    flops = step_flops(QWEN25_05B, layer_params, [prompt + response] * seqs, seqs * response)
    name = torch.cuda.get_device_name()
    peak = peak_tflops(name)
    figures: dict[str, float | str | None] = {
        "device": name, "params_M": total_params / 1e6, "strategy": "fsdp" if fsdp else "replicate",
        "checkpointing": str(checkpointing), "tokens_per_step": tokens, "s_per_step": seconds,
        "tokens_per_s": tokens / seconds, "peak_memory_GiB": torch.cuda.max_memory_allocated() / 2**30,
        "model_TFLOPs_per_s": flops.total / seconds / 1e12, "peak_bf16_TFLOPs": peak,
        "mfu": flops.total / seconds / 1e12 / peak if peak else None,
    }
    print("bench_gpu_step: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in figures.items()), flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--response", type=int, default=768)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--fsdp", action="store_true")
    args = parser.parse_args()
    run(args.seqs, args.prompt, args.response, args.micro, args.steps, args.checkpointing, args.fsdp)


if __name__ == "__main__":
    main()
