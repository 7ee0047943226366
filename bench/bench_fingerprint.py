"""What verifying a weight push costs: the engine's fingerprint of the weights it serves (vLLM CPU, read through its
own kernels) and learner 0's of the weights it sends, against the time of the push itself (the in-place reload).

    python bench/bench_fingerprint.py [--hidden 512 --layers 8] [--dtype float32] [--repeat 5]

Prints the median seconds of each over `--repeat` runs. The default model is bench_async.py's random Llama (hidden
512, 8 layers: 34M parameters); `--hidden 128 --layers 2` is the quickstart's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    import torch

    from distrl.config import from_dict
    from distrl.workers.model_files import DTYPES
    from distrl.workers.rollout.worker import RolloutWorker
    from distrl.workers.tiny_model import make_tiny_model
    from distrl.workers.training.model import load_causal_lm
    from distrl.workers.weights.fingerprint import first_mismatch, of_tensors
    from distrl.workers.weights.pieces import BucketParts

    model_dir = make_tiny_model(tempfile.mkdtemp() + "/model", hidden_size=args.hidden, num_layers=args.layers)
    cfg = from_dict({"model": {"path": str(model_dir)}, "data": {"path": "unused"},
                     "rollout": {"dtype": args.dtype, "sampling": {"max_new_tokens": 8}}})
    engine = RolloutWorker(cfg.rollout, cfg.model, 32, seed=1)
    learner = load_causal_lm(cfg.model, "float32")
    dtype = DTYPES[args.dtype]
    state = learner.state_dict()
    params = sum(t.numel() for t in state.values())
    with torch.no_grad():
        bucket = {k: v.to(dtype) for k, v in state.items()}
    expected = of_tensors(state.items(), dtype)
    assert first_mismatch(expected, engine.llm.collective_rpc("distrl_fingerprint")[0]) is None
    reload = median_seconds(lambda: engine.load_weights(1, [BucketParts.whole(bucket)]), args.repeat)
    served = median_seconds(lambda: engine.llm.collective_rpc("distrl_fingerprint"), args.repeat)
    sent = median_seconds(lambda: of_tensors(learner.state_dict().items(), dtype), args.repeat)
    print(f"model: {params / 1e6:.1f}M parameters, {len(state)} tensors, rollout dtype {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    print(f"in-place reload (the push's load): {reload:.4f} s")
    print(f"engine fingerprint (served):       {served:.4f} s  ({served / reload:.2f}x the reload)")
    print(f"learner fingerprint (sent):        {sent:.4f} s  ({sent / reload:.2f}x the reload)")


if __name__ == "__main__":
    main()
