"""`distrl.workers.openmp.release_threads`: a thread's OpenMP workers end, and the runtime asked is torch's even when
another copy of libgomp was loaded first. In a child process with two OpenMP threads (the tests run with one, and
with one thread no region starts a worker)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, os, threading, time
import sentencepiece  # bundles a libgomp of its own, loaded here before torch's
import torch
from distrl.workers import openmp

def tasks():
    return len(os.listdir("/proc/self/task"))

seen = {}
def compute():
    before = tasks()
    torch.ones(1 << 22).exp_()  # a parallel region: this thread's pool starts its worker, which stays
    seen["started"] = tasks() - before
    seen["released"] = openmp.release_threads()
    deadline = time.monotonic() + 10
    while tasks() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    seen["left"] = tasks() - before
    seen["again"] = (torch.ones(1 << 22).exp_(), tasks() - before)[1]  # the next region starts it again

thread = threading.Thread(target=compute)
thread.start()
thread.join()
pause = openmp.runtime().omp_pause_resource_all
import ctypes
address = ctypes.cast(pause, ctypes.c_void_p).value
for line in open("/proc/self/maps"):
    fields = line.split()
    low, high = (int(x, 16) for x in fields[0].split("-"))
    if low <= address < high:
        seen["library"] = fields[-1]
print(json.dumps(seen))
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads in /proc")
def test_release_threads_ends_the_calling_threads_openmp_workers_of_torchs_runtime():
    pytest.importorskip("sentencepiece")
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=ROOT, timeout=120,
                            env=env, check=False)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["started"] == 1 and seen["released"] is True and seen["left"] == 0 and seen["again"] == 1, seen
    assert "libgomp" in seen["library"] and "sentencepiece" not in seen["library"], seen
