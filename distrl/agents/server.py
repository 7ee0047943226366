"""`AgentServer`: the OpenAI-compatible endpoint a rollout worker serves to agents it did not write.

Each episode gets a base URL of its own, `http://HOST:PORT/episodes/<episode>.<secret>/v1`: an agent hands it to
the OpenAI client (or LangGraph's, or any framework's `base_url`), and every chat completion it asks for there is
served by that episode's `AgentCalls` on the worker's engine, batched with every other episode's turns. Routes:
`POST .../chat/completions` and `GET .../models`. The server runs on the engine's event loop (aiohttp), so a call
costs no thread; it listens on the worker's node address only, and the random part of each episode's path keeps
other processes on the cluster's network from sampling into an episode they were not handed.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from distrl.agents.calls import AgentCalls, CallRefused

MODEL_NAME = "distrl-policy"
"""The model name `GET /models` lists (any name is accepted in a call: the episode's URL decides what serves it)."""


def _error(status: int, message: str, code: str | None = None) -> Any:
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": code}},
                             status=status)


class AgentServer:
    """Serves the calls of the episodes `open` registered; started on the running loop by `start`."""

    def __init__(self) -> None:
        self.episodes: dict[str, AgentCalls] = {}  # by URL path
        self._paths: dict[str, str] = {}  # episode -> its URL path
        self.url = ""
        self._runner: Any = None
        self._listening: Any = None  # the asyncio server of the listening socket

    async def start(self, host: str) -> str:
        """Listen on a free port of `host`; returns the server's URL."""
        from aiohttp import web

        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/episodes/{episode}/v1/chat/completions", self._chat)
        app.router.add_get("/episodes/{episode}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0)
        await site.start()
        self._listening = site._server
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def stop_listening(self) -> None:
        """Close the listening socket at once, on the server's loop (its worker is going away with the loop)."""
        if self._listening is not None:
            self._listening.close()
            self._listening = None

    def open(self, episode: str, calls: AgentCalls) -> str:
        """Serve episode `episode`'s calls with `calls`; returns its base URL."""
        if not self.url:
            raise RuntimeError("AgentServer.open before start")
        path = f"{episode}.{secrets.token_urlsafe(12)}"
        self.episodes[path] = calls
        self._paths[episode] = path
        return f"{self.url}/episodes/{path}/v1"

    def close(self, episode: str) -> None:
        calls = self.episodes.pop(self._paths.pop(episode, ""), None)
        if calls is not None:
            calls.closed = True

    async def _chat(self, request: Any) -> Any:
        from aiohttp import web

        calls = self.episodes.get(request.match_info["episode"])
        if calls is None:
            return _error(404, f"no episode at {request.path} is running on this engine")
        try:
            body = await request.json()
        except json.JSONDecodeError as err:
            return _error(400, f"the request body is not JSON: {err}")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        try:
            return web.json_response(await calls.complete(body))
        except CallRefused as err:
            return _error(err.status, str(err), "distrl_budget" if err.budget else None)

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model",
                                                               "created": 0, "owned_by": "distrl"}]})
