"""Reaper of an embedded Ray cluster whose driver died without shutting it down.

A driver that `ray.init()` started its own cluster stops it on the way out, SIGTERM and Ctrl-C included
(`distrl.stop`). SIGKILL, the OOM killer or a lost terminal leave no way out: GCS, raylet and the workers then die
with the driver, but Ray's dashboard agent and runtime-env agent outlive it (measured with Ray 2.60: still running
minutes later, holding their ports). `start(driver_pid)` spawns this module as a small process in its own session
(so a Ctrl-C meant for the driver does not reach it). It records the driver's process tree every
`POLL_S` seconds and, once the driver is gone, terminates every process it recorded that is still running, then
kills what is left after `GRACE_S`, and removes the directories it was given (the run's Ray token).
`RayBackend.close` stops it after a clean shutdown.

    python -m distrl.cluster.reaper DRIVER_PID [DIRECTORY ...]
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time

POLL_S = 0.5
GRACE_S = 3.0


def start(driver_pid: int, remove: list[str] | tuple[str, ...] = ()) -> subprocess.Popen:
    """Watch `driver_pid`'s process tree from a separate process, which also removes the directories `remove` once
    the driver is gone; returns that process."""
    return subprocess.Popen([sys.executable, "-m", "distrl.cluster.reaper", str(driver_pid), *remove],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def watch(driver_pid: int) -> list[int]:
    """Block until `driver_pid` is gone, then end the processes seen under it; returns the pids it ended."""
    import psutil

    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        return []
    seen: dict[int, psutil.Process] = {}  # Process objects remember their start time: a reused pid is not theirs
    while _alive(driver):
        try:
            for child in driver.children(recursive=True):
                if child.pid != os.getpid():  # this reaper is the driver's child too
                    seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            break
        time.sleep(POLL_S)
    left = [p for p in seen.values() if _alive(p)]
    for proc in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    deadline = time.monotonic() + GRACE_S
    while any(_alive(p) for p in left) and time.monotonic() < deadline:
        time.sleep(0.1)
    for proc in left:
        if _alive(proc):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
    return [p.pid for p in left]


if __name__ == "__main__":
    watch(int(sys.argv[1]))
    for directory in sys.argv[2:]:
        shutil.rmtree(directory, ignore_errors=True)
