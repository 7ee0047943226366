"""OpenEnv environments: a server's `reset` and `step`, through OpenEnv's own client, as distrl episodes.

    data: {function: distrl.standards:seeds, kwargs: {count: 1000}}
    env:
      class: distrl.standards.openenv:OpenEnv
      kwargs: {url: "http://127.0.0.1:8000", action_field: message, observation_field: prompt}
      # or app: my_env.server.app:app   (distrl serves it on 127.0.0.1 in each environment actor, for the run)

An OpenEnv environment is a server (FastAPI, `openenv.core.env_server.create_app`) that holds one environment per
WebSocket session, and a client (`openenv.core.EnvClient`: `reset`, `step`, `state`). Each episode opens a session
of its own (`client`: the environment's own client class, `package.module:Class`; default OpenEnv's
`GenericEnvClient`, which sends and receives plain dicts), `reset`s it with the row's `seed` (and `reset`), shows the
observation to the model as a user message, and `step`s it with each turn's text as the action's `action_field`
(an `action` class builds typed actions). A step's reward is the episode's reward for that step (summed); `done`
ends the episode; the observation's numeric `metadata` values are the episode's figures (`env/<name>`). Many
episodes share a server, one session each (at most `sessions` at once per environment actor when given: the
server's `max_concurrent_envs`). A server that dies, refuses, or does not answer within `env.step_timeout_s` fails
its episodes under `env.on_error` like any environment; a server distrl started is started again for the next
episodes if it died.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from distrl.agents.env import Start, Step, Turn
from distrl.imports import import_spec
from distrl.standards import numeric, require

log = logging.getLogger(__name__)

_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
                    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
"""Run the rest of the command line with PR_SET_PDEATHSIG: the server gets SIGTERM when the process that started
it dies, even by SIGKILL (an environment actor killed by Ray), and so never outlives its run."""
TAIL_BYTES = 4000
"""How much of the end of a server's output an error shows."""


class Server:
    """An OpenEnv app (`package.module:app`) served by uvicorn on 127.0.0.1 at a free port, in a process of its
    own, stopped when this process exits (or dies).

    Its output (stdout and stderr) goes to a file that is unlinked as soon as the server has it open, so that a
    server that logs without end never blocks on a full pipe and leaves no file behind, however this process ends;
    `tail()` reads the end of it (through a descriptor of its own) for the errors that name the server."""

    def __init__(self, app: str):
        self.app = app
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        fd, path = tempfile.mkstemp(prefix="distrl-openenv-", suffix=".log")
        try:
            self.output = os.open(path, os.O_RDONLY)
            self.proc = subprocess.Popen([sys.executable, "-c", _DIE_WITH_PARENT, "-m", "uvicorn", app, "--host",
                                          "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                                         stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT)
        finally:
            os.close(fd)
            os.unlink(path)
        atexit.register(self.stop)

    def tail(self, size: int = TAIL_BYTES) -> str:
        """The last `size` bytes of the server's output, as text."""
        end = os.fstat(self.output).st_size
        return os.pread(self.output, size, max(0, end - size)).decode(errors="replace")

    async def ready(self, timeout_s: float) -> None:
        """Wait until the server answers `/health`; RuntimeError with the end of its output if it exits or
        `timeout_s` passes first."""
        import httpx

        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the OpenEnv server of {self.app} exited with {self.proc.returncode}; the "
                                       f"end of its output:\n{self.tail()}")
                try:
                    if (await http.get(f"{self.url}/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
        raise RuntimeError(f"the OpenEnv server of {self.app} did not answer {self.url}/health within "
                           f"{timeout_s:g} s; the end of its output:\n{self.tail()}")

    def stop(self) -> None:
        """Stop the server (if it runs) and let go of its output."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.output >= 0:
            os.close(self.output)
            self.output = -1
        atexit.unregister(self.stop)


_SERVERS: dict[str, Server] = {}
_STARTING = threading.Lock()
_SESSIONS: dict[tuple[str, int], asyncio.Semaphore] = {}


_CLOSING: set[asyncio.Task[None]] = set()
"""Sessions being closed on the event loop after their episodes: held here until done (the loop keeps only a weak
reference to a task, and the episode's environment is dropped when it ends)."""


def server(app: str) -> Server:
    """This process's server of `app`: started on first use, and again if it died (the end of the dead one's
    output logged as a warning: its episodes failed with a connection error, this says why)."""
    with _STARTING:
        running = _SERVERS.get(app)
        if running is not None and running.proc.poll() is not None:
            log.warning("the OpenEnv server of %s exited with %s; starting it again. The end of its output:\n%s",
                        app, running.proc.returncode, running.tail())
            running.stop()
            running = None
        if running is None:
            _SERVERS[app] = running = Server(app)
        return running


class OpenEnv:
    """An episode of the OpenEnv environment served at `url` (or of `app`, served by distrl). `client`: its
    `EnvClient` class (`package.module:Class`; null: `GenericEnvClient`); `action`: the action class a typed client
    takes (null: a dict); `action_field`: the action's field that holds the model's text; `observation_field`:
    the observation's field shown to the model (null: the observation as JSON, without done, reward and metadata);
    `system_prompt`: a system message before the first observation; `reset`: keyword arguments of every reset
    (the row's `seed` is added when it has one); `sessions`: episodes at once on the server per environment actor
    (null: no limit); `server_timeout_s`: how long a server distrl starts has to answer."""

    def __init__(self, url: str | None = None, app: str | None = None, client: str | None = None,
                 action: str | None = None, action_field: str = "message", observation_field: str | None = None,
                 system_prompt: str | None = None, reset: dict[str, Any] | None = None,
                 sessions: int | None = None, server_timeout_s: float = 60.0):
        if (url is None) == (app is None):
            raise ValueError("give exactly one of url (a running server) and app (package.module:app, served by "
                             "distrl)")
        if sessions is not None and sessions < 1:
            raise ValueError(f"sessions must be at least 1, got {sessions}")
        require("openenv")
        from openenv.core.generic_client import GenericEnvClient

        self.url, self.app, self.server_timeout_s = url, app, server_timeout_s
        self.client_cls = import_spec(client, "OpenEnv client", "Class", "my_env.client:MyEnv") if client else \
            GenericEnvClient
        self.action_cls = import_spec(action, "OpenEnv action", "Class", "my_env.models:MyAction") if action else None
        self.action_field, self.observation_field = action_field, observation_field
        self.system_prompt, self.reset_kwargs, self.sessions = system_prompt, dict(reset or {}), sessions
        self.client: Any = None
        self.session: asyncio.Semaphore | None = None

    async def start(self, row: dict[str, Any]) -> Start:
        url = self.url
        if self.app is not None:
            served = server(self.app)
            await served.ready(self.server_timeout_s)
            url = served.url
        assert url is not None
        self.client = self.client_cls(base_url=url)
        if self.sessions is not None:
            session = _SESSIONS.setdefault((url, id(asyncio.get_running_loop())), asyncio.Semaphore(self.sessions))
            await session.acquire()
            self.session = session  # held from here: close() gives it back
        await self.client.connect()
        seed = {"seed": row["seed"]} if row.get("seed") is not None else {}
        result = await self.client.reset(**self.reset_kwargs, **seed)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
        return Start(messages=[*messages, {"role": "user", "content": self._text(result.observation)}])

    async def step(self, turn: Turn) -> Step:
        fields = {self.action_field: turn.text}
        result = await self.client.step(self.action_cls(**fields) if self.action_cls is not None else fields)
        observation = result.observation
        metrics = numeric(_field(observation, "metadata") or {})
        reward = float(result.reward) if result.reward is not None else None
        if result.done:
            return Step(reward=reward, done=True, metrics=metrics)
        return Step(messages=[{"role": "user", "content": self._text(observation)}], reward=reward, metrics=metrics)

    def close(self) -> None:
        if self.client is None:
            return
        closing = _close(self.client, self.session)
        self.client = self.session = None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(closing)
            return
        # The session ends on the server when its WebSocket closes, which waits on the network: on the event
        # loop, after the episode.
        task = loop.create_task(closing)
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)

    def _text(self, observation: Any) -> str:
        """What the model is shown of `observation`: its `observation_field`, or all of it but done, reward and
        metadata as JSON."""
        if self.observation_field is not None:
            value = _field(observation, self.observation_field)
            if value is None:
                raise KeyError(f"the observation has no field {self.observation_field!r} (observation_field); it "
                               f"has {sorted(_fields(observation))}")
            return value if isinstance(value, str) else json.dumps(value)
        shown = {k: v for k, v in _fields(observation).items() if k not in ("done", "reward", "metadata")}
        return json.dumps(shown)


async def _close(client: Any, session: asyncio.Semaphore | None) -> None:
    """Close `client`'s session and give its place back (`session`). A client that fails to close is logged, not
    raised: the episode is over, and `close()` must not raise (`distrl.agents.env`)."""
    task = asyncio.ensure_future(client.close())
    await asyncio.wait([task])
    if session is not None:
        session.release()
    if not task.cancelled() and task.exception() is not None:
        log.warning("closing an OpenEnv session failed: %s: %s", type(task.exception()).__name__, task.exception())


def _fields(observation: Any) -> dict[str, Any]:
    """An observation's fields: a typed observation's (pydantic), or the dict `GenericEnvClient` gives."""
    if isinstance(observation, dict):
        return observation
    return observation.model_dump() if hasattr(observation, "model_dump") else vars(observation)


def _field(observation: Any, name: str) -> Any:
    return _fields(observation).get(name)
