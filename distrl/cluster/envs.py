"""Environment actors: `EnvHost`s in Ray actors of their own (`cluster.env`), and the client through which a
rollout worker's episodes reach them.

An environment actor is an asyncio actor (`EnvHost`'s methods are coroutines) that runs many episodes at once, so
an environment waiting on I/O holds no process. Episodes are spread over the actors by a hash of their id, and an
episode's calls all go to the actor that holds its environment. An actor that dies is restarted in place by Ray
(at most `cluster.recovery.max_restarts` times); the calls it had in flight fail with `EnvLost`, and their
episodes start again from their first turn, counted in `faults/env_restarted_episodes`.
"""

from __future__ import annotations

import zlib
from typing import Any

from distrl.agents.env import Start, Step, Turn
from distrl.agents.host import EnvLost
from distrl.cluster.group import ActorGroup, RayGroup

EPISODES_PER_ACTOR = 4096
"""Calls one environment actor runs at once (its coroutines): more than any engine has episodes in flight."""


def _actor_of(episode: str, n: int) -> int:
    return zlib.crc32(episode.encode()) % n


class RayEnvClient:
    """Episodes' calls to environment actors `actors` (Ray actor handles of `EnvHost`)."""

    def __init__(self, actors: list[Any]):
        self.actors = actors

    async def start(self, episode: str, row: dict[str, Any]) -> Start:
        return await self._call(episode, "start", row)

    async def step(self, episode: str, turn: Turn) -> Step:
        return await self._call(episode, "step", turn)

    async def run(self, episode: str, row: dict[str, Any], base_url: str) -> float:
        return await self._call(episode, "run", row, base_url)

    def end(self, episode: str) -> None:
        self.actors[_actor_of(episode, len(self.actors))].end.remote(episode)  # nothing to wait for

    async def _call(self, episode: str, method: str, *args: Any) -> Any:
        from ray.exceptions import RayActorError, RayTaskError

        index = _actor_of(episode, len(self.actors))
        try:
            return await getattr(self.actors[index], method).remote(episode, *args)
        except RayActorError as err:
            raise EnvLost(f"environment actor env-{index} died during {method} of episode {episode}: {err}") from err
        except RayTaskError as err:
            raise err.as_instanceof_cause() from None  # EnvTimeout, EnvFailed, EnvError as themselves


class LocalEnvClient:
    """The same over `EnvHost`s (or `AgentHost`s) in this process (`cluster.backend: local`)."""

    def __init__(self, hosts: list[Any]):
        self.hosts = hosts

    async def start(self, episode: str, row: dict[str, Any]) -> Start:
        return await self.hosts[_actor_of(episode, len(self.hosts))].start(episode, row)

    async def step(self, episode: str, turn: Turn) -> Step:
        return await self.hosts[_actor_of(episode, len(self.hosts))].step(episode, turn)

    async def run(self, episode: str, row: dict[str, Any], base_url: str) -> float:
        return await self.hosts[_actor_of(episode, len(self.hosts))].run(episode, row, base_url)

    def end(self, episode: str) -> None:
        self.hosts[_actor_of(episode, len(self.hosts))].end(episode)


def env_client(group: ActorGroup) -> RayEnvClient | LocalEnvClient:
    """The client of environment group `group` (a `RayGroup` or a `LocalGroup` of `EnvHost`s or `AgentHost`s)."""
    return RayEnvClient(list(group.workers)) if isinstance(group, RayGroup) else LocalEnvClient(list(group.workers))


def node_address() -> str:
    """The address of the node this process runs on, as Ray knows it (127.0.0.1 outside a Ray worker): where a
    rollout worker serves its agents' endpoint. Handed to the worker as a function, called in its own process."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
