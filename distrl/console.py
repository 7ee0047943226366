"""distrl's own lines on the driver's console, kept apart from the libraries' output.

The console carries distrl's lines, the progress bar and what a user must act on; what vLLM, Ray, torch and
transformers print inside the actors (environment checks, deprecations, their own progress) goes to the run's
library log (`run.library_logs`). An actor's stdout reaches the driver through Ray's log forwarding, mixed with
those libraries' lines; `say` marks distrl's own lines there, so that the driver
(`distrl.cluster.library_log`) keeps them on the console and sends the rest to the file.

No Ray, torch or vLLM here: the driver, the workers and the in-process backend all import it.
"""

from __future__ import annotations

import os
import sys

MARK = "[distrl] "
"""Opens each of distrl's own lines printed inside a Ray actor (stripped again on the driver)."""
IN_ACTOR = "DISTRL_RAY_ACTOR"
"""Set in every Ray actor's environment (`distrl.cluster.backend`): its lines travel through Ray's forwarding."""


def say(text: str, err: bool = False) -> None:
    """Print one of distrl's lines: on the driver's console above the progress bar, or, inside a Ray actor, on
    its stdout marked for the driver to show (`err`: stderr on the driver's console)."""
    if os.environ.get(IN_ACTOR):
        print(MARK + text, flush=True)
    else:
        write(text, err=err)


def write(text: str, err: bool = False) -> None:
    """A line on this process's console that does not break the progress bar (tqdm clears it, writes, redraws)."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stderr if err else sys.stdout)
    (sys.stderr if err else sys.stdout).flush()
