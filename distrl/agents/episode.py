"""One episode, turn by turn: the model samples a turn on the engine, the environment answers, the observation's
ids are appended, until the environment is done or a budget ends it. The result is one sample of `Rollouts`:
token-exact (the ids the engine was given and sampled, checked against what it echoes), with a loss mask over the
model's tokens, the sampler's log-probs and the policy version of every token.

A reward-function job runs the same coroutine without an environment: one turn, scored afterwards.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from distrl.agents.calls import AgentCalls
from distrl.agents.chat import ChatRenderer
from distrl.agents.env import Start, Step, Turn
from distrl.agents.host import EnvError, EnvFailed, EnvLost, EnvTimeout
from distrl.agents.tool_calls import ToolCallParser
from distrl.agents.trajectory import Budget, EpisodeResult, Trajectory, TurnSampler, drift, turn_seed
from distrl.types.rollouts import Episode, Rollouts


class EnvClient(Protocol):
    """Where episodes' environments (or agent functions) run: `start`/`step` an environment's episode, or `run` an
    agent's whole episode against the endpoint at `base_url` (its reward)."""

    async def start(self, episode: str, row: dict[str, Any]) -> Start: ...

    async def step(self, episode: str, turn: Turn) -> Step: ...

    async def run(self, episode: str, row: dict[str, Any], base_url: str) -> float: ...

    def end(self, episode: str) -> None: ...


class AgentEndpoint(Protocol):
    """The rollout worker's OpenAI-compatible endpoint (`distrl.agents.server.AgentServer`)."""

    def open(self, episode: str, calls: AgentCalls) -> str: ...

    def close(self, episode: str) -> None: ...


@dataclass
class _Progress:
    """What an episode has done so far."""

    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    parse_errors: int = 0
    env_wait_s: float = 0.0
    engine_s: float = 0.0
    drift: int = 0
    reward: float = 0.0
    cut: str | None = None
    finish: str = "length"
    texts: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    def episode(self, template_drift: bool) -> Episode:
        return Episode(turns=self.turns, tool_calls=self.tool_calls, tool_errors=self.tool_errors,
                       parse_errors=self.parse_errors, env_wait_s=self.env_wait_s, engine_s=self.engine_s,
                       reward=self.reward, cut=self.cut, drift=self.drift, template_drift=template_drift,
                       metrics=dict(self.metrics))


def as_rollouts(episodes: list[list[EpisodeResult]], groups: list[int], n: int, version: int) -> Rollouts:
    """`Rollouts` of the episodes of `len(groups)` prompts, `n` each in order (prompt-major), each episode one
    sample per sequence (`Episode.segment`); `version` is the engine's now, for samples without a trained token."""
    out = Rollouts.empty()
    for i, sequences in enumerate(episodes):
        for result in sequences:
            traj = result.trajectory
            out.add(list(traj.prompt_ids), traj.response_ids, traj.logprobs, traj.mask, traj.versions, result.text,
                    result.finish_reason, groups[i // n], result.episode, version, traj.routes)
    return out.validate()


class EpisodeRunner:
    """Runs episodes on `sampler`; with `envs`, multi-turn against them (tool calls parsed by `parser`), else one
    turn each; with `endpoint` too, `envs` runs agent functions whose calls `endpoint` serves."""

    def __init__(self, sampler: TurnSampler, chat: ChatRenderer, budget: Budget, envs: EnvClient | None = None,
                 parser: ToolCallParser | None = None, end_of_turn: int | None = None, max_restarts: int = 0,
                 endpoint: AgentEndpoint | None = None):
        self.sampler, self.chat, self.budget, self.envs, self.parser = sampler, chat, budget, envs, parser
        self.end_of_turn, self.max_restarts, self.endpoint = end_of_turn, max_restarts, endpoint

    def resampled(self, sampler: TurnSampler, max_new_tokens: int) -> EpisodeRunner:
        """The same runner sampling its turns with `sampler`, `max_new_tokens` a turn (an evaluation's); a one-turn
        episode's token budget is its turn."""
        budget = dataclasses.replace(self.budget, max_new_tokens=max_new_tokens,
                                     max_tokens=self.budget.max_tokens if self.envs is not None else max_new_tokens)
        return EpisodeRunner(sampler, self.chat, budget, self.envs, self.parser, self.end_of_turn, self.max_restarts,
                             self.endpoint)

    async def run(self, episode_id: str, prompt_ids: list[int], row: dict[str, Any], seed: int,
                  sample: int) -> list[EpisodeResult]:
        """The episode's samples: one, or one per sequence of an agent's episode (`Episode.segment`)."""
        if self.envs is None:
            traj = Trajectory(prompt_ids)
            first = await self.sampler.sample(prompt_ids, self._room(traj), turn_seed(seed, sample, 0))
            traj.add_turn(first)
            return [EpisodeResult(traj, first.text, first.finish_reason,
                                  Episode(drift=drift(first.prompt_ids, prompt_ids), engine_s=first.engine_s))]
        play = self._agent if self.endpoint is not None else self._multi_turn
        for attempt in range(self.max_restarts + 1):
            # A restarted episode gets an id of its own: its host may still hold the lost attempt's environment.
            attempt_id = episode_id if not attempt else f"{episode_id}.r{attempt}"
            try:
                results = await play(attempt_id, prompt_ids, row, seed, sample)
            except EnvLost as err:
                if attempt == self.max_restarts:
                    raise EnvLost(f"episode {episode_id}: its environment's host died {attempt + 1} times, more "
                                  f"than cluster.recovery.max_restarts = {self.max_restarts}: {err}") from err
                continue
            finally:
                self.envs.end(attempt_id)
            results[0].episode = dataclasses.replace(results[0].episode, restarts=attempt)
            return results
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _agent(self, episode_id: str, prompt_ids: list[int], row: dict[str, Any], seed: int,
                     sample: int) -> list[EpisodeResult]:
        """An agent function's episode: it runs where `envs` runs it, its calls come back to `endpoint`."""
        assert self.envs is not None and self.endpoint is not None
        calls = AgentCalls(self.sampler, self.chat, self.budget, self.parser, self.end_of_turn, seed, sample)
        base_url = self.endpoint.open(episode_id, calls)
        began = time.perf_counter()
        reward = 0.0
        try:
            reward = await self.envs.run(episode_id, row, base_url)
        except EnvTimeout:
            calls.cut = calls.cut or "env_timeout"
        except EnvError:
            # An agent that fails on a call refused for its budget was cut, not broken; one that fails because the
            # engine failed serving it is the engine's failure (raised below).
            if calls.cut is None and calls.failure is None:
                raise
        except EnvFailed:
            calls.cut = calls.cut or "env_error"
        finally:
            self.endpoint.close(episode_id)
        if calls.failure is not None:
            raise calls.failure
        return calls.results(reward, prompt_ids, time.perf_counter() - began)

    def _room(self, traj: Trajectory) -> int:
        b = self.budget
        return min(b.max_new_tokens, b.max_tokens - len(traj.response_ids), b.context - len(traj.ids))

    def _over(self, traj: Trajectory, extra: int) -> str | None:
        b = self.budget
        if len(traj.ids) + extra >= b.context:
            return "context"
        if len(traj.response_ids) + extra >= b.max_tokens:
            return "max_tokens"
        return None

    async def _multi_turn(self, episode_id: str, prompt_ids: list[int], row: dict[str, Any], seed: int,
                          sample: int) -> list[EpisodeResult]:
        assert self.envs is not None
        progress = _Progress()
        began = time.perf_counter()
        try:
            start = await self.envs.start(episode_id, row)
        except (EnvTimeout, EnvFailed) as err:
            progress.env_wait_s = time.perf_counter() - began
            return [self._failed_start(prompt_ids, progress, err)]
        progress.env_wait_s += time.perf_counter() - began
        messages = list(start.messages) if start.messages is not None else []
        if start.messages is not None:
            prompt_ids = self.chat.prompt_ids(messages, start.tools)
        traj = Trajectory(prompt_ids)
        for index in range(self.budget.max_turns):
            progress.cut = self._over(traj, 0)
            if progress.cut or await self._turn(episode_id, traj, messages, start.tools, progress,
                                                turn_seed(seed, sample, index), index):
                break
        else:
            progress.cut = "max_turns"
        template_drift = start.messages is not None and self.chat.template_drift(messages, start.tools, traj.ids)
        return [EpisodeResult(traj, "".join(progress.texts), progress.finish, progress.episode(template_drift))]

    async def _turn(self, episode_id: str, traj: Trajectory, messages: list[dict], tools: list[dict],
                    progress: _Progress, seed: int, index: int) -> bool:
        """Sample turn `index`, let the environment answer it and append the observation; whether the episode
        ended (`progress.cut` says why, when a budget or the environment's failure ended it)."""
        assert self.envs is not None
        room = self._room(traj)
        turn = await self.sampler.sample(traj.ids, room, seed)
        progress.drift += drift(turn.prompt_ids, traj.ids)
        progress.engine_s += turn.engine_s
        traj.add_turn(turn)
        progress.turns += 1
        progress.finish = turn.finish_reason
        progress.texts.append(turn.text)
        if turn.finish_reason == "length" and room < self.budget.max_new_tokens:
            progress.cut = self._over(traj, 0) or "max_tokens"  # the episode's budget, not the turn's, ran out
            return True
        content, calls, parse_error = (self.parser.parse(turn.text) if self.parser is not None
                                       else (turn.text, [], None))
        parsed = Turn(turn.text, content, calls, parse_error, index, turn.finish_reason)
        progress.tool_calls += len(calls)
        progress.parse_errors += parse_error is not None
        messages.append(parsed.as_message())
        began = time.perf_counter()
        try:
            step = await self.envs.step(episode_id, parsed)
        except EnvTimeout:
            progress.cut = "env_timeout"
            return True
        except EnvFailed:
            progress.cut, progress.reward = "env_error", 0.0
            return True
        finally:
            progress.env_wait_s += time.perf_counter() - began
        progress.reward += step.reward or 0.0
        progress.tool_errors += step.tool_errors
        progress.metrics.update(step.metrics)
        if step.done:
            return True
        # A turn cut at rollout.sampling.max_new_tokens did not write its end-of-turn token: the template's is
        # given to the model (not trained on) before the observation, as the template would have written it.
        closed = turn.finish_reason != "length"
        end = turn.token_ids[-1] if closed else self.end_of_turn
        if end is None:
            raise ValueError("a turn that reached rollout.sampling.max_new_tokens needs the end-of-turn token "
                             "(the tokenizer's eos_token) to be closed before the environment's answer")
        observation = ([] if closed else [end]) + self.chat.observation_ids(step.messages, tools, end)
        progress.cut = self._over(traj, len(observation))
        if progress.cut:
            return True
        traj.add_observation(observation, self.sampler.version)
        messages.extend(step.messages)
        return False

    def _failed_start(self, prompt_ids: list[int], progress: _Progress, err: Exception) -> EpisodeResult:
        """An episode whose environment failed to start: no turn, nothing to train on, reward 0."""
        progress.cut = "env_timeout" if isinstance(err, EnvTimeout) else "env_error"
        return EpisodeResult(Trajectory(prompt_ids), "", "length", progress.episode(False))
