"""Where the lines that Ray forwards from the actors go (`run.library_logs`).

Ray's driver prints every line an actor writes to stdout or stderr, vLLM's, torch's and transformers' included
(environment checks, deprecations, their own progress bars), between the progress bar's redraws. While a run lasts
the driver's handler of those lines is this module's: distrl's own lines (`distrl.console.say`, marked) go to the
console above the progress bar; the rest go to RUN_DIR/libraries.log, each after the actor's name and pid as Ray
prints them, or with `run.library_logs: console` to the console as well. The raylet's and the autoscaler's lines
(a worker killed for memory, a node that does not come up) stay on the console: a user acts on them.

Ray keeps its own copy of every actor's output either way (the dashboard's logs, and the session directory's
`worker-*.out` files on each node). The handler is Ray's private `global_worker_stdstream_dispatcher` (Ray 2.60, as
pinned); where it is missing, Ray's own printing is left as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, TextIO

from distrl.console import MARK, write

LOG_NAME = "libraries.log"
RAY_HANDLER = "ray_print_logs"  # the name Ray's driver gives its handler (ray._private.worker.connect)
HANDLER = "distrl_lines"


class ForwardedLines:
    """Handles one batch of forwarded lines: {"lines": [...], "pid", "is_err", "actor_name" or "task_name"}."""

    def __init__(self, log: TextIO | None):
        self.log = log  # None: the libraries' lines to the console too

    def __call__(self, data: dict[str, Any]) -> None:
        from ray._private.worker import filter_autoscaler_events

        pid = data.get("pid")
        who = data.get("actor_name") or data.get("task_name") or ""
        err = bool(data.get("is_err"))
        lines = data.get("lines", [])
        if pid in ("raylet", "autoscaler"):  # Ray's word on its workers and nodes: a user acts on it
            # Of the autoscaler's status reports Ray's own printing shows only the events.
            for line in filter_autoscaler_events(lines) if pid == "autoscaler" else lines:
                write(f"({pid}) {line}", err=True)
            return
        for line in lines:
            if line.startswith(MARK):
                write(line[len(MARK):], err=err)
            elif self.log is not None:
                self.log.write(f"({who} pid={pid}) {line}\n")
            else:
                write(f"({who} pid={pid}) {line}", err=err)


@contextmanager
def forwarded_lines(log_path: Path | None) -> Iterator[None]:
    """Replace Ray's printing of the actors' lines with `ForwardedLines` until the block ends (`log_path`: the
    libraries' lines to this file, appended; None: to the console). Nothing is replaced where this driver does not
    forward the actors' lines (`ray.init(log_to_driver=False)`). Leave it after `ray.shutdown()` where the run
    shuts Ray down, so that the lines Ray forwards until then are handled here too."""
    import ray

    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:  # another Ray: its own printing stays
        yield
        return
    ray_own = [(name, handler) for name, handler in dispatcher.handlers if name == RAY_HANDLER]
    if not ray_own:
        yield
        return
    with open(log_path, "a", buffering=1) if log_path is not None else nullcontext() as log:
        dispatcher.remove_handler(RAY_HANDLER)
        dispatcher.add_handler(HANDLER, ForwardedLines(log))
        try:
            yield
        finally:
            dispatcher.remove_handler(HANDLER)  # under the dispatcher's lock: no batch is half-handled
            if ray.is_initialized():  # else Ray removed its own at the shutdown, and adds it at the next init
                for name, handler in ray_own:
                    dispatcher.add_handler(name, handler)
