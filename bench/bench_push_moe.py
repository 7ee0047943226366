"""What a weight push costs for a mixture of experts against a dense model of the same size, and what routing
replay's routes weigh per token.

    PYTHONPATH=. .venv/bin/python bench/bench_push_moe.py [--hidden 512] [--layers 8] [--pushes 5]

Two random models of the same parameter count, built here: a Qwen3-MoE with every layer's MLP 8 experts of
intermediate size hidden / 2 (2 per token: distrl's tiny MoE, `make_tiny_model(arch="qwen3_moe")`), and its dense
twin, a Qwen3 of the same attention, norms and embeddings whose every MLP has the experts' total intermediate size,
4 * hidden (3 * hidden * 4 * hidden parameters a layer either way; the MoE adds its routers, 8 * hidden a layer).
Each is pushed (`WeightSync.push`: the learner's buckets into the object store, the engine's streamed reload, the
fingerprint check of every tensor, the router and each expert included) from one learner into one engine of one
worker (vLLM's CPU build, float32) on an embedded Ray cluster (`bench_push_tp.layout`); median of `--pushes` pushes
after a warm-up push, with the check and without it (`cluster.verify_weights`). Then the routes' size: layers x
experts per token x bytes per index (uint8 up to 256 experts, else 16 bits, vLLM's own), per token and per sample,
for the tiny model and the models the issue names.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MODELS = [  # name, MoE layers, experts per token, experts (their configs on the hub)
    ("Qwen3-30B-A3B", 48, 8, 128), ("Qwen3-235B-A22B", 94, 8, 128), ("DeepSeek-V3 (58 of 61 layers MoE)", 58, 8, 256),
    ("Kimi-K2 (60 of 61 layers MoE)", 60, 8, 384)]


def route_bytes(layers: int, top_k: int, experts: int) -> int:
    """Bytes of one token's routes: an expert index per layer and slot, 1 byte up to 256 experts, else 2."""
    return layers * top_k * (1 if experts <= 256 else 2)


def dense_twin(moe_dir: Path, out: Path) -> Path:
    """A random dense Qwen3 of the same shape as the Qwen3-MoE of `moe_dir` (attention, norms, embeddings) whose every
    MLP is one of the experts' total intermediate size. (vLLM's Qwen3-MoE needs a sparse layer: a Qwen3-MoE whose
    every layer is dense does not load.)"""
    import torch
    from transformers import AutoConfig, Qwen3Config, Qwen3ForCausalLM

    moe = AutoConfig.from_pretrained(moe_dir)
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "bos_token_id",
            "eos_token_id", "pad_token_id")
    config = Qwen3Config(**{k: getattr(moe, k) for k in keep if hasattr(moe, k)},
                         intermediate_size=moe.num_experts * moe.moe_intermediate_size, dtype="float32")
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (moe_dir / name).exists():
            shutil.copy(moe_dir / name, out / name)
    return out


def parameters(model_dir: Path) -> tuple[int, int]:
    """(parameters, tensors) of the model's checkpoint."""
    from safetensors import safe_open

    count = tensors = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open's handle is not a mapping
                count += f.get_tensor(key).numel()
                tensors += 1
    return count, tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=32)
    parser.add_argument("--routes-only", action="store_true", help="print the routes' sizes alone (no push)")
    args = parser.parse_args()

    from distrl.workers.tiny_model import EXPERTS, EXPERTS_PER_TOKEN

    mib = 2**20
    if not args.routes_only:
        from bench_push_tp import layout

        from distrl.workers.tiny_model import make_tiny_model

        with tempfile.TemporaryDirectory() as work:
            moe = make_tiny_model(Path(work) / "moe", arch="qwen3_moe", hidden_size=args.hidden,
                                  num_layers=args.layers)
            dense = dense_twin(moe, Path(work) / "dense")
            seconds = {}
            for name, model in (("MoE  ", moe), ("dense", dense)):
                count, tensors = parameters(model)
                for verify in (True, False):
                    r = layout(model, Path(work) / f"run-{name.strip()}-{verify}", 1, 1, args.pushes, args.bucket_mb,
                               (f"cluster.verify_weights={str(verify).lower()}",))
                    seconds[name, verify] = r["seconds"]
                    print(f"{name}: {count / 1e6:.2f} M parameters in {tensors} checkpoint tensors; push "
                          f"{'with' if verify else 'without'} its check {r['seconds']:.3f} s (model "
                          f"{r['total'] / mib:.1f} MiB, buckets of {args.bucket_mb} MiB)", flush=True)
            for verify in (True, False):
                print(f"push {'with' if verify else 'without'} the check, MoE / dense: "
                      f"{seconds['MoE  ', verify] / seconds['dense', verify]:.2f}x")
    tokens = 32768
    print(f"routes per token (layers x experts per token x bytes), and per sample of {tokens} tokens:")
    for name, layers, top_k, experts in [(f"tiny Qwen3-MoE ({args.layers} layers)", args.layers, EXPERTS_PER_TOKEN,
                                          EXPERTS), *MODELS]:
        per_token = route_bytes(layers, top_k, experts)
        print(f"  {name}: {layers} x {top_k} x {1 if experts <= 256 else 2} B = {per_token} B/token; "
              f"{per_token * tokens / mib:.1f} MiB per {tokens}-token sample")


if __name__ == "__main__":
    main()
