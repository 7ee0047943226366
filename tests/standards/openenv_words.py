"""An OpenEnv environment as OpenEnv's packages write one: typed Action and Observation models, an `Environment`
whose sessions are independent (`SUPPORTS_CONCURRENT_SESSIONS`), the FastAPI app `create_app` serves it with, and
the `EnvClient` that speaks to it. The game: the observation names a word (the reset's seed picks it); the player
should say it; each step rewards 1 if the message holds the word, and the episode ends after `ROUNDS` steps.

Served by `uvicorn tests.standards.openenv_words:app`; `SLOW_WORD` makes a step hang (for the time-out tests)."""

from __future__ import annotations

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

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> WordObservation:
        self.word = WORDS[(seed or 0) % len(WORDS)]
        self._state = State(episode_id=episode_id or "", step_count=0)
        return WordObservation(prompt=f"Say the word {self.word}.", done=False, reward=None)

    def step(self, action: WordAction, timeout_s: float | None = None, **kwargs: Any) -> WordObservation:
        if SLOW_WORD in action.message:
            time.sleep(60)
        self._state.step_count += 1
        reward = float(self.word in action.message)
        done = self._state.step_count >= ROUNDS
        return WordObservation(prompt=f"Again: say {self.word}.", said=action.message, done=done, reward=reward,
                               metadata={"length": len(action.message)})

    @property
    def state(self) -> State:
        return self._state


app = create_app(WordEnvironment, WordAction, WordObservation, max_concurrent_envs=64)


class WordEnv(EnvClient[WordAction, WordObservation, State]):
    def _step_payload(self, action: WordAction) -> dict[str, Any]:
        return {"message": action.message}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[WordObservation]:
        observation = WordObservation(**payload["observation"], done=payload.get("done", False),
                                      reward=payload.get("reward"))
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)
