"""The reaper ends what a driver killed with SIGKILL leaves behind (Ray's agents outlive it otherwise), and only
that: processes it never saw under the driver are left alone."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from distrl.cluster import reaper

psutil = pytest.importorskip("psutil")
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
# A stand-in for the driver: the reaper started from the driver itself, as RayBackend does (so the reaper is the
# driver's first child), with a directory to remove (the run's Ray token), then a child that would outlive the
# driver.
def driver_cmd(remove: str) -> list[str]:
    return [sys.executable, "-c", "import os, subprocess, time\n"
            "from distrl.cluster import reaper\n"
            f"reaper.start(os.getpid(), [{remove!r}])\n"
            f"subprocess.Popen({SLEEPER!r})\n"
            "time.sleep(600)\n"]


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_killed_drivers_descendants_are_ended_and_nothing_else(tmp_path):
    token = tmp_path / "distrl-ray-token"
    token.mkdir()
    (token / "auth_token").write_text("secret")
    bystander = subprocess.Popen(SLEEPER)
    driver = subprocess.Popen(driver_cmd(str(token)))
    try:
        assert wait_until(lambda: len(psutil.Process(driver.pid).children()) == 2, timeout=30)
        orphan, watcher = sorted(psutil.Process(driver.pid).children(), key=lambda p: "reaper" in " ".join(p.cmdline()))
        time.sleep(4 * reaper.POLL_S + 1)  # the reaper has started and seen the tree
        driver.kill()
        driver.wait()
        assert wait_until(lambda: not reaper._alive(orphan), timeout=reaper.GRACE_S + 10), "the orphan outlived it"
        assert wait_until(lambda: not reaper._alive(watcher), timeout=10)  # and the reaper is done
        assert bystander.poll() is None  # never under the driver: left alone
        assert not token.exists()  # the run's token went with it
    finally:
        for proc in (driver, bystander):
            proc.kill()
            proc.wait()


def test_a_reaper_of_a_finished_driver_exits_at_once():
    assert reaper.watch(2**22 + 12345) == []  # no such process (pid_max is at most 2**22)
