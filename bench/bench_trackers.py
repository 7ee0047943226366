"""What logging a step costs the driver, per sink and tracker: JSONL, TensorBoard, W&B (offline) and MLflow (a
tracking server this script starts on 127.0.0.1, its store in a temporary directory).

    python bench/bench_trackers.py [--keys 80] [--steps 50]

Each logs `--steps` rows of `--keys` figures (a row of the quickstart holds about 60 to 90) and prints the median
and the slowest milliseconds of one step's log; for a tracker, first its own `log` call (what its sending thread
spends per row), then `--steps` more rows through `Trackers` (what the driver waits: queueing them), and its start
and finish. Needs the `trackers` and `test` extras (the latter for the server).
HOME and W&B's directories are pointed at the temporary directory; W&B is offline, so nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def start_mlflow_server(root: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "art")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, cwd=root)
    uri, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                return server, uri
        except OSError:
            time.sleep(0.5)
    os.killpg(server.pid, 9)
    raise RuntimeError("mlflow server not up in 180 s")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def per_step(log, rows: list[dict]) -> str:
    """The median and slowest time of `log(step, row)` over `rows`."""
    times = []
    for step, row in enumerate(rows, 1):
        start = time.perf_counter()
        log(step, row)
        times.append(time.perf_counter() - start)
    return f"median {statistics.median(times) * 1e3:7.2f} ms, max {max(times) * 1e3:7.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=80)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-trackers-"))
    os.environ.update(HOME=str(root), WANDB_MODE="offline", WANDB_ERROR_REPORTING="false", WANDB_SILENT="true",
                      **{name: str(root / name.lower()) for name in ("WANDB_DIR", "WANDB_CONFIG_DIR",
                                                                     "WANDB_CACHE_DIR", "WANDB_DATA_DIR")})

    from distrl.config import from_dict
    from distrl.metrics import JsonlSink, TensorBoardSink
    from distrl.trackers import TRACKERS, Trackers

    server, uri = start_mlflow_server(root)
    try:
        cfg = from_dict({"model": {"path": "m"}, "data": {"path": "d"}, "run": {
            "trackers": ["jsonl", "tensorboard", "wandb", "mlflow"], "wandb": {"mode": "offline"},
            "mlflow": {"tracking_uri": uri}}})
        config = cfg.model_dump(mode="json", by_alias=True)
        rng = random.Random(0)
        rows = [{f"figure/{k}": rng.random() for k in range(args.keys)} for _ in range(args.steps)]
        sinks = {"jsonl": JsonlSink(root / "metrics.jsonl"), "tensorboard": TensorBoardSink(root / "tensorboard")}
        for name, sink in sinks.items():
            print(f"{name:12s} log: {per_step(sink.write, rows)}")
            sink.close()
        for name in ("wandb", "mlflow"):
            tracker = TRACKERS[name](cfg, root)
            start = timed(lambda t=tracker: t.start(config, None))
            sent = per_step(tracker.log, rows)  # the tracker's own call, as its thread makes it
            trackers = Trackers([tracker])
            queued = per_step(lambda step, row, t=trackers: t.log(step + args.steps, row), rows)
            finish = timed(lambda t=trackers: t.finish("finished"))  # waits for the queued rows to be sent
            print(f"{name:12s} log: {sent}; the driver's wait (queued): {queued}; start {start:.2f} s (imports "
                  f"included), finish {finish:.2f} s (sending the {args.steps} queued rows included)")
    finally:
        os.killpg(server.pid, 9)
        server.wait()
    print(f"{args.steps} steps of {args.keys} figures each; files in {root}")


if __name__ == "__main__":
    main()
