"""An OpenEnv environment as OpenEnv's packages write one: typed Action and Observation models, an `Environment`
whose sessions are independent (`SUPPORTS_CONCURRENT_SESSIONS`), the FastAPI app `create_app` serves it with, and
the `EnvClient` that speaks to it. The game: the observation names a word (the reset's seed picks it, or its
`word`); the player should say it; each step rewards 1 if the message holds the word, and the episode ends after
`ROUNDS` steps.

Served by `uvicorn tests.standards.openenv_words:app` (at most 64 sessions at once; `narrow_app`: 2). `SLOW_WORD`
makes a step hang (for the time-out tests); `LOUD_WORD` makes it write `LOUD_BYTES` to stderr (a server that logs
much). `CountingWordEnv` is the client with a count of its connections open at once in this process."""

from __future__ import annotations

import sys
import time
from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger"]
ROUNDS = 2
SLOW_WORD = "sleep"
LOUD_WORD = "shout"
LOUD_BYTES = 100_000
"""More than a pipe holds (64 KB on Linux): a server whose stderr is a pipe no one reads blocks on it."""


class WordAction(Action):
    message: str


class WordObservation(Observation):
    prompt: str
    said: str = ""


class WordEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id="", step_count=0)
        self.word = WORDS[0]

    def reset(self, seed: int | None = None, episode_id: str | None = None, word: str | None = None,
              **kwargs: Any) -> WordObservation:
        self.word = WORDS[(seed or 0) % len(WORDS)] if word is None else word
        self._state = State(episode_id=episode_id or "", step_count=0)
        return WordObservation(prompt=f"Say the word {self.word}.", done=False, reward=None)

    def step(self, action: WordAction, timeout_s: float | None = None, **kwargs: Any) -> WordObservation:
        if SLOW_WORD in action.message:
            time.sleep(60)
        if LOUD_WORD in action.message:
            print(f"{LOUD_WORD} " * (LOUD_BYTES // (len(LOUD_WORD) + 1)), file=sys.stderr, flush=True)
        self._state.step_count += 1
        reward = float(self.word in action.message)
        done = self._state.step_count >= ROUNDS
        return WordObservation(prompt=f"Again: say {self.word}.", said=action.message, done=done, reward=reward,
                               metadata={"length": len(action.message)})

    @property
    def state(self) -> State:
        return self._state


app = create_app(WordEnvironment, WordAction, WordObservation, max_concurrent_envs=64)
narrow_app = create_app(WordEnvironment, WordAction, WordObservation, max_concurrent_envs=2)


class WordEnv(EnvClient[WordAction, WordObservation, State]):
    def _step_payload(self, action: WordAction) -> dict[str, Any]:
        return {"message": action.message}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[WordObservation]:
        observation = WordObservation(**payload["observation"], done=payload.get("done", False),
                                      reward=payload.get("reward"))
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)


CONNECTIONS = {"open": 0, "most": 0}
"""`CountingWordEnv`'s connections open now, and the most open at once."""


class CountingWordEnv(WordEnv):
    counted = False

    async def _connect_async(self) -> WordEnv:  # OpenEnv calls it before every message: counted once
        connected = await super()._connect_async()
        if not self.counted:
            self.counted = True
            CONNECTIONS["open"] += 1
            CONNECTIONS["most"] = max(CONNECTIONS["most"], CONNECTIONS["open"])
        return connected

    async def _close_async(self) -> None:
        await super()._close_async()
        if self.counted:
            self.counted = False
            CONNECTIONS["open"] -= 1
