"""What a weight push costs into a tensor-parallel engine, and who sends and receives what: one engine of 1 or 2
worker processes (`rollout.tensor_parallel_size`), fed by 1 replicated learner or 2 FSDP learners, on an embedded
Ray cluster on this host (the roles the driver starts, `distrl.cluster.roles.started_roles`; the object store
between learners and engine).

    PYTHONPATH=. .venv/bin/python bench/bench_push_tp.py [--hidden 512] [--layers 8] [--pushes 5]

Per layout: the push's wall time (`WeightSync.push`: every learner's pieces into the object store, the engine's
streamed reload in every worker, the per-worker fingerprint check; median of `--pushes` after one warm-up push), the
bytes each learner sends (its pieces of every bucket), and per worker: its share (the bytes of the regions it holds,
which its loaders copy out of the shared buckets; the rest of a bucket it maps but never reads) and the shared
segments the engine keeps (a few buckets, `--bucket-mb` each, mapped by every worker). A last line compares TP 2
with TP 1 for each learner count.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def layout(model: Path, out: Path, tp: int, learners: int, pushes: int, bucket_mb: int,
           overrides: tuple[str, ...] = ()) -> dict:
    import ray

    from distrl import config
    from distrl.cluster.backend import connect
    from distrl.cluster.roles import started_roles
    from distrl.workers.rollout.worker import RolloutWorker
    from distrl.workers.training.learner import Learner

    cfg = config.load(ROOT / "configs" / "quickstart.yaml", [
        f"model.path={model}", f"run.output_dir={out}", "eval=null", f"rollout.tensor_parallel_size={tp}",
        f"cluster.learner.num_actors={learners}", "cluster.reference.num_actors=1", "loss.kl.coef=0",
        f"learner.strategy.type={'fsdp' if learners > 1 else 'replicate'}", "learner.micro_batch_size=8",
        f"learner.mini_batch_size={8 * learners}", f"cluster.sync_bucket_bytes={bucket_mb * 2**20}",
        f"run.name=push-tp{tp}-l{learners}", *overrides])
    backend = connect(cfg.cluster)
    try:
        with started_roles(cfg, backend) as roles:
            roles.sync.push(version=0)  # warm-up: the engine's first reload
            seconds = []
            for version in range(1, pushes + 1):
                started = time.perf_counter()
                roles.sync.push(version=version)
                seconds.append(time.perf_counter() - started)
            sent = [0] * learners
            for spec in roles.sync.specs:
                for i, pieces in enumerate(ray.get(roles.learner.map(Learner.weight_pieces, spec, cfg.rollout.dtype))):
                    sent[i] += pieces.nbytes
            shapes = {name: shape for spec in roles.sync.specs for name, shape in spec}
            item = 4  # float32
            share = [sum(item * (math.prod(shapes[name]) if region is None
                                 else region[2] * math.prod(shapes[name]) // shapes[name][region[0]])
                         for name, region in regions if name in shapes)
                     for regions in ray.get(roles.rollout.call(0, RolloutWorker.worker_regions))]
    finally:
        backend.close()
    return {"seconds": statistics.median(seconds), "sent": sent, "share": share, "total": roles.sync.total_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=32)
    args = parser.parse_args()

    from distrl.workers.tiny_model import make_tiny_model

    mib = 2**20
    with tempfile.TemporaryDirectory() as work:
        model = make_tiny_model(Path(work) / "model", hidden_size=args.hidden, num_layers=args.layers)
        results = {}
        for learners in (1, 2):
            for tp in (1, 2):
                r = results[tp, learners] = layout(Path(model), Path(work) / f"run-{tp}-{learners}", tp, learners,
                                                   args.pushes, args.bucket_mb)
                print(f"TP {tp}, {learners} learner{'s' if learners > 1 else ' '}: push {r['seconds']:.3f} s "
                      f"(model {r['total'] / mib:.1f} MiB); sent per learner "
                      f"{', '.join(f'{b / mib:.1f}' for b in r['sent'])} MiB; per worker: share "
                      f"{', '.join(f'{b / mib:.1f}' for b in r['share'])} MiB (buckets of {args.bucket_mb} MiB)",
                      flush=True)
    ratios = {n: results[2, n]["seconds"] / results[1, n]["seconds"] for n in (1, 2)}
    print(f"push TP 2 / TP 1: 1 learner {ratios[1]:.2f}x, 2 learners {ratios[2]:.2f}x")


if __name__ == "__main__":
    main()
