"""The quickstart on the session's cluster with its engine over two worker processes (`rollout.tensor_parallel_size:
2`, vLLM's CPU build): it learns, every push verified on both workers, and one worker process killed mid-run loses
the engine, which is replaced like a dead one. (In its own module: the in-process engines of
`test_tensor_parallel.py` are gone by then, so every vLLM worker process found here is the run's.)"""

import os
import time

from tests.e2e.conftest import all_ended, start_quickstart
from tests.e2e.faults import finish, kill_process, processes, rows_of


def test_the_quickstart_learns_on_a_tp2_engine_whose_killed_worker_process_loses_the_engine(ray_session, tmp_path):
    """The quickstart with one engine over two worker processes, every push verified on both workers. One worker
    process is killed mid-run: the rollout actor ends with it, and the engine is replaced like a dead one (its
    prompts kept, the current weights pushed to both new workers and verified); every step is logged once, the
    policy learns, and no worker process is left behind."""
    steps = 30
    proc, metrics = start_quickstart(tmp_path, f"run.steps={steps}", "rollout.tensor_parallel_size=2",
                                     cluster=ray_session)
    time.sleep(3)  # a step or two more with the first engine
    kill_process(os.getpid(), "VLLM::Worker_TP1")  # the engine's second worker process
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "rollout actor rollout-0 (replacement 1) serves policy version" in out, out[-3000:]
    rows = rows_of(metrics)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert sum(r["faults/rollout_restarts"] for r in rows) == 1
    first, last = (sum(r["reward/mean"] for r in part) / 5 for part in (rows[:5], rows[-5:]))
    assert last > first + 0.15, f"did not learn: first 5 steps {first:.3f}, last 5 steps {last:.3f}"
    assert all(abs(r["correction/mismatch_kl"]) < 1e-6 for r in rows)  # float32 on both sides, both workers
    assert all_ended(processes(os.getpid(), "VLLM::Worker"), timeout=30) == []
