"""An engine's memory during a weight push: distrl's push (streamed bucket by bucket, each bucket read in place from
the object store: `export.Bucket`) against the push as it was (every bucket a top-level argument of the load, which
Ray resolves before the call, its tensors pickled as torch pickles them), against streaming with torch's pickling,
and against vLLM reloading the same weights from its own files, where nothing is received: the engine's own cost of
a reload, which any way of updating its weights in place pays.

    python bench/bench_push_memory.py [--arch llama|qwen2] [--hidden 512 --layers 8] [--bucket-mb 4] [--rounds 3]

A real deployment (embedded Ray cluster on 127.0.0.1, a vLLM CPU engine actor, a transformers learner actor, the
object-store weight sync, verification off so that only the load is measured). A thread inside the engine's process
reads its anonymous resident memory (`RssAnon` of /proc/self/status: heap and anonymous mappings, which is where
received tensors live; the object store's shared memory, mapped by every reader, is not counted) every millisecond
from just before a push until it is loaded. Prints, per push, the steady state before it, the peak during it, and
the peak's excess over the steady state in MB, in bucket sizes and in model sizes; the four kinds alternate.
glibc's malloc is told to serve every allocation of 64 KiB or more with its own mapping (MALLOC_MMAP_THRESHOLD_),
so freed tensors leave the resident set at once instead of staying cached in the heap, where they would hide the
next push's allocations.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import threading
import time
from pathlib import Path

os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # before Ray starts: its workers inherit the environment

ROOT = Path(__file__).resolve().parents[1]


def rss_anon_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


class PeakSampler:
    """Runs in the engine's process: samples RssAnon every `period_s` on a thread, from `start` until `stop`."""

    def __init__(self, period_s: float = 0.001):
        self.period_s = period_s
        self.steady = self.peak = 0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        self.steady = self.peak = rss_anon_bytes()
        self._done.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self.steady

    def _run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, rss_anon_bytes())
            time.sleep(self.period_s)

    def stop(self) -> tuple[int, int]:
        self._done.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, rss_anon_bytes())
        return self.steady, self.peak


def start_sampler(engine) -> int:
    engine._push_memory = getattr(engine, "_push_memory", None) or PeakSampler()
    return engine._push_memory.start()


def stop_sampler(engine, _loaded: int) -> tuple[int, int]:
    """`_loaded` is the load's result: an argument so that this runs once the load is done."""
    return engine._push_memory.stop()


def pickled_bucket(learner, spec, dtype: str) -> dict:
    """A bucket as a plain dict, whose tensors Ray pickles as torch does (rebuilt through an in-band copy)."""
    return dict(learner.weight_bucket(spec, dtype))


def whole_model_load(engine, version: int, *buckets):
    """The push as it was: every bucket is a top-level argument, all in this process before loading starts."""
    return engine.load_weights(version, list(buckets))


def reload_from_files(engine, version: int) -> int:
    """vLLM's own reload of the model's files (safetensors read one tensor at a time), through the same layer-wise
    reload as a push: what reloading costs the engine when nothing has to be received."""
    engine.llm.collective_rpc("reload_weights", kwargs={"is_checkpoint_format": True})
    engine.llm.reset_prefix_cache()
    return version


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", choices=["llama", "qwen2"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from distrl import config
    from distrl.cluster.backend import RayBackend
    from distrl.workers.tiny_model import make_tiny_model

    tmp = Path(tempfile.mkdtemp())
    model = make_tiny_model(tmp / "model", arch=args.arch, hidden_size=args.hidden, num_layers=args.layers)
    bucket_bytes = int(args.bucket_mb * 2**20)
    cfg = config.load(ROOT / "configs" / "quickstart.yaml", [
        f"model.path={model}", "model.create_tiny_if_missing=false", f"run.output_dir={tmp}", "run.progress=false",
        "loss.kl.coef=0.0", "rollout.dtype=float32", f"cluster.sync_bucket_bytes={bucket_bytes}",
        "cluster.verify_weights=false", "eval=null"])
    backend = RayBackend(cfg.cluster)
    try:
        measure(args, backend, cfg)
    finally:
        backend.close()


def largest_layer_bytes(specs: list) -> int:
    """Bytes (float32) of the largest layer vLLM processes as one: q/k/v and gate/up are fused there."""
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"}
    layers: dict[str, int] = {}
    for spec in specs:
        for name, shape in spec:
            module, leaf = name.rsplit(".", 1)[0].rpartition(".")[::2]
            key = f"{module}.{fused.get(leaf, leaf)}"
            layers[key] = layers.get(key, 0) + 4 * math.prod(shape)
    return max(layers.values())


def measure(args, backend, cfg) -> None:
    import ray

    from distrl.cluster.roles import started_roles
    from distrl.cluster.weight_sync import ObjectStoreSync, StreamedBuckets

    with started_roles(cfg, backend) as roles:
        sync = roles.sync
        assert isinstance(sync, ObjectStoreSync)
        sizes = [4 * sum(math.prod(shape) for _, shape in spec) for spec in sync.specs]
        sync.push(version=0)  # the engine's first reload, out of the measurement
        engine, learner = roles.rollout.workers[0], roles.learner.workers[0]
        layer = largest_layer_bytes(sync.specs)
        print(f"model: {args.arch}, hidden {args.hidden}, {args.layers} layers: {sync.total_bytes / 2**20:.1f} MB "
              f"in float32, {len(sizes)} buckets of at most {max(sizes) / 2**20:.1f} MB "
              f"(cluster.sync_bucket_bytes = {args.bucket_mb:g} MB); largest layer as vLLM processes it "
              f"(q/k/v and gate/up fused): {layer / 2**20:.1f} MB")
        print(f"{'push':<18}{'steady MB':>11}{'peak MB':>10}{'excess MB':>11}{'buckets':>9}{'layers':>8}{'models':>8}")
        kinds = ("whole model", "streamed, pickled", "streamed", "vLLM from files")
        excess: dict[str, list[float]] = {kind: [] for kind in kinds}
        version = 0
        for _ in range(args.rounds):
            for kind in kinds:
                version += 1
                ray.get(engine.__ray_call__.remote(start_sampler))
                if kind == "streamed":
                    pending = sync.start(version)
                    loaded = pending.handles[0]
                elif kind == "vLLM from files":
                    loaded = engine.__ray_call__.remote(reload_from_files, version)
                else:
                    buckets = [learner.__ray_call__.remote(pickled_bucket, spec, sync.dtype) for spec in sync.specs]
                    loaded = (engine.__ray_call__.remote(whole_model_load, version, *buckets) if kind == "whole model"
                              else engine.load_weights.remote(version, StreamedBuckets(buckets)))
                steady, peak = ray.get(engine.__ray_call__.remote(stop_sampler, loaded))
                if kind == "streamed":
                    sync.finish(pending)
                over = peak - steady
                excess[kind].append(over)
                print(f"{kind:<18}{steady / 2**20:>11.1f}{peak / 2**20:>10.1f}{over / 2**20:>11.1f}"
                      f"{over / max(sizes):>9.2f}{over / layer:>8.2f}{over / sync.total_bytes:>8.2f}")
                time.sleep(0.5)
        whole, pickled, streamed, files = (sorted(excess[k])[len(excess[k]) // 2] for k in kinds)
        print(f"median excess: whole model {whole / 2**20:.1f} MB, streamed and pickled {pickled / 2**20:.1f} MB, "
              f"streamed {streamed / 2**20:.1f} MB, vLLM from files {files / 2**20:.1f} MB")
        print(f"streamed push over vLLM's own reload: {(streamed - files) / 2**20:.1f} MB = "
              f"{(streamed - files) / max(sizes):.2f} of the largest bucket")


if __name__ == "__main__":
    main()
