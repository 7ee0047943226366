"""A gem environment written as gem's are (a `gem.Env` registered with `gem.register`) whose step hangs when the
model says `HANG`, until the test lets it go (`RELEASE`); any other turn ends the episode with reward 1. Registered
as `test:Hang-v0` when imported."""

from __future__ import annotations

import threading
from typing import Any

import gem

ENV_ID = "test:Hang-v0"
HANG = "hang"
RELEASE = threading.Event()
CLOSED: list[int] = []
"""The seeds of the environments closed, in order."""


class HangEnv(gem.Env):
    def __init__(self) -> None:
        self.seed = -1

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed)
        self.seed = seed if seed is not None else -1
        return f"Episode {self.seed}: say anything.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if HANG in action:
            RELEASE.wait(120)
        return "", 1.0, True, False, {"seed": self.seed}

    def close(self) -> None:
        CLOSED.append(self.seed)


gem.register(ENV_ID, entry_point=HangEnv)
