"""Faults injected into running quickstarts: an actor's process killed, waits with a deadline for a run's output."""

import json
import time
from collections import Counter

import psutil
import pytest


def kill_actor(root_pid: int, cls: str) -> None:
    """SIGKILL the one actor process of class `cls` under process `root_pid` (Ray titles it `ray::<cls>...`): the
    driver of an embedded cluster, or this process for the session's cluster, whose nodes it started."""
    kill_process(root_pid, f"ray::{cls}")


def processes(root_pid: int, title: str) -> list[psutil.Process]:
    """The processes under `root_pid` whose title (a part of their command line) starts with `title`."""

    def parts(p) -> list[str]:
        try:
            return [] if p.status() == psutil.STATUS_ZOMBIE else p.cmdline()
        except psutil.Error:  # a worker that exited (or is a zombie) while we looked
            return []

    return [p for p in psutil.Process(root_pid).children(recursive=True)
            if any(part.startswith(title) for part in parts(p))]


def kill_process(root_pid: int, title: str) -> None:
    """SIGKILL the one process under `root_pid` whose title starts with `title` (an actor, `ray::<class>`; a vLLM
    engine's worker process, `VLLM::Worker_TP<rank>`)."""

    # On the session's cluster an earlier run's actor may still be ending: wait (briefly) until one is left.
    deadline = time.monotonic() + 15
    while True:
        found = processes(root_pid, title)
        if len(found) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert len(found) == 1, [p.pid for p in found]
    found[0].kill()


def finish(proc) -> tuple[str, str]:
    """The run's output once it exits (within 300 s; killed, with its cluster, if it does not)."""
    try:
        return proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def wait_for_checkpoint(proc, manifest, within_s: float = 60) -> None:
    """Wait until the run writes checkpoint `manifest` (killed, failing the test, if it does not within `within_s`)."""
    deadline = time.monotonic() + within_s
    while not manifest.exists():
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {manifest} within {within_s:g} s:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.1)


def rows_of(metrics) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def trained_tickets(run, last: int) -> dict[int, Counter]:
    """Step -> how many samples of each prompt ticket it trained, for steps 1 .. `last`, read from the samples the
    run wrote (`run.samples_every=1` with `run.samples_per_write` at least a batch's samples: all of them)."""
    return {step: Counter(json.loads(line)["ticket"]
                          for line in (run / "samples" / f"step_{step:06d}.jsonl").read_text().splitlines())
            for step in range(1, last + 1)}


def check_each_prompt_trained_once(run, last: int, n: int, k: int) -> None:
    """Steps 1 .. `last` of `run` (its checkpoint of step `last` written, nothing dropped or filtered): every prompt
    trained in one step only, with its `n` samples (never trained twice); the prompts its checkpoint records as
    consumed are exactly those (a resumed run draws the others again); and none drawn before a prompt trained at
    least k + 3 steps before the last is missing (a group is trained within k steps of a younger one, give or take
    the slice a lost engine took with it: older and missing is lost)."""
    by_step = trained_tickets(run, last)
    for step, counts in by_step.items():
        assert set(counts.values()) == {n}, (step, counts)
    trained = [t for counts in by_step.values() for t in counts]
    assert len(trained) == len(set(trained)), [t for t, c in Counter(trained).items() if c > 1]
    data = json.loads((run / "checkpoints" / f"step_{last:06d}" / "driver_state.json").read_text())["data"]
    assert set(range(data["next"])) | set(data["consumed"]) == set(trained)
    settled = [t for step in range(1, last - k - 2) for t in by_step[step]]
    assert settled, f"{last} steps leave none settled at k = {k}"
    missing = sorted(set(range(max(settled))) - set(trained))
    assert not missing, missing
