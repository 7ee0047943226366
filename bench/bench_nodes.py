"""Several Ray nodes on this host (tests/e2e/nodes.py: a head, an inference and a training node, each its own raylet
and object store, token auth, 127.0.0.1): what a weight push costs across nodes against one node, and how long a run
takes to recover from a lost node.

    PYTHONPATH=. .venv/bin/python bench/bench_nodes.py [--hidden 512] [--layers 8] [--rounds 2] [--losses 2]

- **Push.** The synchronous quickstart on a model of `--hidden` x `--layers` (fp32), 4 steps, learner on the head,
  the engine on the head (one node) or on the inference node (the buckets cross between the two object stores);
  rounds interleaved. Reported: `time/sync` (learner 0's export, the engine's streamed reload and its fingerprint
  check) and `sync/bytes_per_s`, medians over steps 2-4, and the ratio across / one node.
- **A lost node.** `distrl train` joined to the cluster (the quickstart, checkpoints every 2 steps) with one role on
  a node of its own, lost (raylet and every process on it killed) once step 5 is logged (the newest checkpoint is
  step 4's: half an interval, the average), and a node with the same label added at once (an autoscaler's or a
  restarted machine's). For the engine: seconds from the loss to the next finished step, and to the replacement's
  first row; for the learner: to the first row after the recovery, and the steps redone (rows logged after the
  checkpoint and logged again).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.nodes import Nodes, Watch, joined  # noqa: E402 - the repository's own multi-node helper


def push_round(out: Path, model: Path, engine_pool: str) -> tuple[float, float]:
    from distrl import config
    from distrl.driver import train

    cfg = config.load(ROOT / "configs" / "quickstart.yaml", [
        f"model.path={model}", f"run.output_dir={out}", "run.progress=false", "eval=null", "run.steps=4",
        "rollout.prompts_per_step=4", "rollout.sampling.max_new_tokens=8", "learner.micro_batch_size=8",
        "cluster.learner.labels={pool: head}", "cluster.reference.labels={pool: head}",
        f"cluster.rollout.labels={{pool: {engine_pool}}}", f"run.name=push-{engine_pool}",
        "cluster.sync_bucket_bytes=33554432"])
    rows = train(cfg)[1:]
    return (statistics.median(r["time/sync"] for r in rows), statistics.median(r["sync/bytes_per_s"] for r in rows))


def loss_round(nodes: Nodes, out: Path, model: Path, role: str) -> dict[str, float]:
    """One run with `role` (rollout or learner) on a `pool: lost` node, lost once step 5 is logged (the newest
    checkpoint step 4's)."""
    out.mkdir(parents=True)
    doomed = nodes.add(labels={"pool": "lost"})
    run = out / out.name  # a run name of its own: the actors of the round before may still be on their way out
    watch = Watch(joined(nodes, out, f"run.name={out.name}", "run.steps=100000", "run.checkpoint_every=2",
                         f"cluster.{role}.labels={{pool: lost}}", "cluster.recovery.start_timeout_s=300", model=model),
                  run)
    try:
        # Mid-way between checkpoints (every 2 steps): step 5 logged, its checkpoint not due until step 6.
        watch.until("step 5", lambda rows: len(rows) >= 5)
        logged = len(watch.rows())
        killed = nodes.lose(doomed)
        nodes.add(labels={"pool": "lost"})
        key = "faults/rollout_restarts" if role == "rollout" else "faults/recoveries"
        watch.until("a step after the loss", lambda rows: len(rows) > logged or any(r.get(key) for r in rows))
        first_step = time.monotonic() - killed
        rows = watch.until("the recovery", lambda rows: any(r.get(key) for r in rows), within_s=600)
        recovered = time.monotonic() - killed
        redone = logged - (next(i for i, r in enumerate(rows) if r.get(key)))
        watch.stop()
    finally:
        if watch.proc.poll() is None:
            watch.proc.kill()
        nodes.remove_added()  # the next round's role lands on its own doomed node, not this one's replacement
    return {"next step s": first_step, "recovered s": recovered, "steps redone": float(max(0, redone))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="push rounds per placement (0: none)")
    parser.add_argument("--losses", type=int, default=2, help="lost-node runs per role")
    args = parser.parse_args()

    import ray

    from distrl.workers.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-nodes-") as tmp, Nodes.start() as nodes:
        work = Path(tmp)
        model = make_tiny_model(work / "model", hidden_size=args.hidden, num_layers=args.layers)
        small = make_tiny_model(work / "tiny-model")
        ray.init(address=nodes.address)
        try:
            pushes: dict[str, list[tuple[float, float]]] = {"head": [], "inference": []}
            for r in range(args.rounds):
                for pool, rounds in pushes.items():
                    rounds.append(push_round(work / f"push-{pool}-{r}", model, pool))
        finally:
            ray.shutdown()
        if args.rounds:
            print(f"\npush of the {args.hidden} x {args.layers} model (fp32), median of steps 2-4 per round:")
            print(f"{'engine on':<22}{'time/sync s':>14}{'MB/s':>10}")
            for pool, label in (("head", "the learner's node"), ("inference", "another node")):
                for seconds, rate in pushes[pool]:
                    print(f"{label:<22}{seconds:>14.3f}{rate / 1e6:>10.1f}")
            across, one = (statistics.median(s for s, _ in pushes[pool]) for pool in ("inference", "head"))
            print(f"across nodes / one node: {across / one:.2f}x")

        print("\na lost node (the quickstart; its role alone on the node; a node with its label added at once):")
        print(f"{'role':<10}{'next step s':>13}{'recovered s':>13}{'steps redone':>14}")
        for role in ("rollout", "learner"):
            for k in range(args.losses):
                figures = loss_round(nodes, work / f"loss-{role}-{k}", small, role)
                print(f"{role:<10}{figures['next step s']:>13.1f}{figures['recovered s']:>13.1f}"
                      f"{figures['steps redone']:>14.0f}")


if __name__ == "__main__":
    main()
