"""The run's console against the library log: distrl's own lines marked in the actors and shown on the driver, the
libraries' lines that Ray forwards sent to RUN_DIR/libraries.log (or, with --verbose, to the console)."""

import io

from distrl import cli
from distrl.cluster.library_log import ForwardedLines
from distrl.console import IN_ACTOR, MARK, say

AUTOSCALER_REPORT = ["======== Autoscaler status: 2026-11-29 01:30:20 ========", "Node status", " (no failures)",
                     ":event_summary:Resized to 4 CPUs."]


def events_only(lines):
    """Ray's filter of the autoscaler's lines (v1 form; Ray's asks the cluster which autoscaler runs)."""
    return (line.split(":event_summary:")[1] for line in lines if ":event_summary:" in line)


def test_say_marks_a_line_inside_a_ray_actor_and_prints_it_plainly_elsewhere(capsys, monkeypatch):
    monkeypatch.delenv(IN_ACTOR, raising=False)
    say("rollout actor rollout-0 serves policy version 3")
    say("reference: auto = 4096 tokens", err=True)
    out, err = capsys.readouterr()
    assert out == "rollout actor rollout-0 serves policy version 3\n" and err == "reference: auto = 4096 tokens\n"
    monkeypatch.setenv(IN_ACTOR, "1")
    say("learner: max_tokens_per_micro_batch auto = 4096 tokens")
    assert capsys.readouterr().out == MARK + "learner: max_tokens_per_micro_batch auto = 4096 tokens\n"


def test_forwarded_lines_keep_distrls_and_rays_own_on_the_console_and_send_the_libraries_to_the_log(capsys,
                                                                                                   monkeypatch):
    monkeypatch.setattr("ray._private.worker.filter_autoscaler_events", events_only)
    log = io.StringIO()
    lines = ForwardedLines(log)
    lines({"pid": 5199, "actor_name": "RolloutWorker", "is_err": True,
           "lines": ["WARNING [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD.",
                     MARK + "rollout engine (pid 5199): torn; ending this process"]})
    lines({"pid": 5200, "task_name": "score_batch", "is_err": False, "lines": ["a reward function's print"]})
    lines({"pid": "raylet", "is_err": True, "lines": ["A worker died or was killed while executing a task"]})
    lines({"pid": "autoscaler", "is_err": False, "lines": AUTOSCALER_REPORT})  # its events only
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ("rollout engine (pid 5199): torn; ending this process\n"
                   "(raylet) A worker died or was killed while executing a task\n"
                   "(autoscaler) Resized to 4 CPUs.\n")
    assert log.getvalue() == ("(RolloutWorker pid=5199) WARNING [cpu_worker.py:114] libtcmalloc is not found in "
                              "LD_PRELOAD.\n(score_batch pid=5200) a reward function's print\n")


def test_forwarded_lines_without_a_log_show_the_libraries_on_the_console_after_the_actors_name(capsys):
    ForwardedLines(None)({"pid": 5199, "actor_name": "RolloutWorker", "is_err": False,
                          "lines": ["INFO chunked prefill", MARK + "serves policy version 1"]})
    assert capsys.readouterr().out == "(RolloutWorker pid=5199) INFO chunked prefill\nserves policy version 1\n"


def test_verbose_brings_the_libraries_back_to_the_console(monkeypatch, tmp_path):
    loaded = {}
    monkeypatch.setattr(cli.config, "load", lambda path, overrides: loaded.setdefault("overrides", overrides))
    monkeypatch.setattr("distrl.driver.train", lambda cfg: None)
    assert cli.main(["train", "--config", "c.yaml", "--set", "run.steps=2", "--verbose"]) == 0
    assert loaded["overrides"] == ["run.steps=2", "run.library_logs=console"]
    loaded.clear()
    assert cli.main(["train", "--config", "c.yaml"]) == 0
    assert loaded["overrides"] == []
