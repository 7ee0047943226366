"""verifiers environments (Prime Intellect's Environments Hub) trained by distrl as they are.

    data: {function: distrl.standards.verifiers:rows, kwargs: {env_id: my-env, env_args: {...}}}
    env:  {class: distrl.standards.verifiers:VerifiersEnv, kwargs: {env_id: my-env, env_args: {...}}}

A verifiers environment is a package whose `load_environment(**env_args)` returns a `vf.Environment`
(`SingleTurnEnv`, `MultiTurnEnv`, `ToolEnv`, ...): its data set, system prompt, tools, `env_response` and stop
conditions, and a `Rubric` that scores a rollout. `rows` reads its data set (or its evaluation set); `VerifiersEnv`
plays an episode by running the environment's own `run_rollout` (rollout, then rubric) against an OpenAI client
whose every chat completion is one of the episode's turns: the request's messages start the episode (the first
call) or end in the observation of the turn before (the messages after that turn's reply), and the reply is the
turn distrl sampled, its tool calls parsed by `env.tool_parser`. The client is `openai.AsyncOpenAI` over an
in-process transport (no socket): verifiers runs exactly the code it runs against a vLLM server. distrl holds the
token ids throughout (the observations are rendered as template deltas), so trajectories are token-exact and
every token carries its policy version. When the rollout ends, the rubric's reward is the episode's reward and its
components (`state["metrics"]`: each reward function and metric by name) are the episode's figures (`env/<name>`).

What a rollout records as its own error (`state["error"]`) is verifiers' outcome: the model's empty or malformed
reply, a tool error the environment stops on; the rollout is scored as verifiers scores it and counted in
`env/error`. A failure of the environment itself (an exception, an infrastructure error, a request distrl cannot
serve) fails the episode under `env.on_error`.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from distrl.agents.calls import UNSERVED, template_message
from distrl.agents.env import Start, Step, Turn
from distrl.standards import require

MODEL = "distrl"
"""The model name verifiers is given (distrl samples with the job's policy whatever it is called)."""
MODEL_ERRORS = ("InvalidModelResponseError", "EmptyModelResponseError", "ToolParseError", "ToolCallError")
"""Errors a rollout records that are the model's doing (its reply, its tool call): the rollout is scored."""

_ENVIRONMENTS: dict[str, Any] = {}
_LOADING = threading.Lock()


@contextmanager
def _signal_handlers_skipped() -> Iterator[None]:
    """Constructing a verifiers environment installs a SIGINT handler (its teardown on Ctrl-C), which Python
    allows only on the main thread; an environment actor's coroutines run on another (Ray's asyncio thread). Off
    the main thread the handler is not installed (Ray, not the environment, handles the actor's signals)."""
    if threading.current_thread() is threading.main_thread():
        yield
        return
    install = signal.signal
    signal.signal = lambda signum, handler: signal.getsignal(signum)  # type: ignore[assignment]  # see docstring
    try:
        yield
    finally:
        signal.signal = install


def load(env_id: str, env_args: dict[str, Any] | None = None) -> Any:
    """The environment `load_environment(**env_args)` of package `env_id` returns: loaded once per process."""
    vf = require("verifiers")
    key = json.dumps([env_id, env_args or {}], sort_keys=True, default=str)
    with _LOADING:
        if key not in _ENVIRONMENTS:
            with _signal_handlers_skipped():
                env = vf.load_environment(env_id, **(env_args or {}))
            if env.message_type != "chat":
                raise ValueError(f"verifiers environment {env_id!r} is a {env.message_type!r} environment; distrl "
                                 f"trains chat environments (message_type 'chat')")
            _ENVIRONMENTS[key] = env
        return _ENVIRONMENTS[key]


def problems(kwargs: dict[str, Any], tool_parser: str | None) -> list[str]:
    """The preflight's lines for `VerifiersEnv(**kwargs)` with `env.tool_parser`: an environment that offers tools
    (a `ToolEnv`) needs the model's tool-call format, without which the model's calls would reach verifiers as
    plain text and never run."""
    env_id = kwargs.get("env_id")
    if tool_parser is not None or not isinstance(env_id, str):
        return []
    try:
        env = load(env_id, kwargs.get("env_args"))
    except (TypeError, ValueError, KeyError, AssertionError, ImportError) as err:  # as data.function's rows
        return [f"env.kwargs: cannot load verifiers environment {env_id!r}: {type(err).__name__}: {err}"]
    tools = [tool["function"]["name"] for tool in getattr(env, "oai_tools", None) or []]
    if not tools:
        return []
    return [f"env.tool_parser: verifiers environment {env_id!r} offers tools ({', '.join(tools)}) and env.tool_parser "
            f"is null, so the model's tool calls would never be parsed and run; set it to the model's tool-call "
            f"format (e.g. hermes for Qwen2.5)"]


def rows(env_id: str, env_args: dict[str, Any] | None = None, split: str = "train",
         count: int | None = None) -> list[dict[str, Any]]:
    """The rows of environment `env_id`'s data set (`split` "train") or evaluation set ("eval"; its data set when
    it has none, as verifiers does), the first `count` of them (null: all): its prompt (chat messages, the system
    prompt included), answer, info, task and example id."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    env = load(env_id, env_args)
    n = count if count is not None else -1
    dataset = env.get_dataset(n=n) if split == "train" else env.get_eval_dataset(n=n)
    out = []
    for row in dataset:
        out.append({"prompt": [{k: v for k, v in m.items() if v is not None} for m in row["prompt"]],
                    "answer": row.get("answer") or "", "info": row.get("info") or {},
                    "task": row.get("task") or "default", "example_id": row.get("example_id", 0)})
    return out


def _http_module() -> Any:
    """The HTTP library the installed OpenAI client is built on (`httpx`, or `httpx2` from openai 3 on): the
    transport answers with its responses."""
    import importlib

    import openai

    base = next(c for c in openai.DefaultAsyncHttpxClient.__mro__
                if c.__name__ == "AsyncClient" and not c.__module__.startswith("openai"))
    return importlib.import_module(base.__module__.split(".")[0])


class _Turns:
    """The transport under the episode's OpenAI client: each chat completion verifiers asks for waits until
    distrl answers it with the episode's next turn (`reply`)."""

    def __init__(self) -> None:
        self.requests: asyncio.Queue[tuple[dict[str, Any], asyncio.Future[dict[str, Any]]]] = asyncio.Queue()

    async def handle_async_request(self, request: Any) -> Any:
        httpx = _http_module()
        body = json.loads(await request.aread())
        refused = ([f"'{name}'" for name in UNSERVED if body.get(name) is not None]
                   + (["'n' > 1"] if (body.get("n") or 1) > 1 else [])
                   + (["'stream'"] if body.get("stream") else []))
        if not request.url.path.endswith("/chat/completions") or refused:
            what = ", ".join(refused) or f"{request.method} {request.url.path}"
            return httpx.Response(400, json={"error": {"message": f"distrl does not serve {what} (the policy "
                                                                  f"samples each turn)", "type": "invalid_request"}})
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        await self.requests.put((body, reply))
        return httpx.Response(200, json=await reply)

    async def aclose(self) -> None:
        """Nothing to close: no socket is opened."""


def completion(turn: Turn, model: str) -> dict[str, Any]:
    """`turn` as an OpenAI chat completion: its content, its tool calls (arguments as JSON text), and why it
    ended ("tool_calls", "stop" or "length")."""
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = [{"id": call.id or f"call_{turn.index}_{k}", "type": "function",
                                  "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                                 for k, call in enumerate(turn.tool_calls)]
    finish = "tool_calls" if turn.tool_calls else turn.finish_reason
    return {"id": f"chatcmpl-distrl-{turn.index}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}]}


class VerifiersEnv:
    """An episode of verifiers environment `env_id` (`load_environment(**env_args)`), on a row of `rows`."""

    def __init__(self, env_id: str, env_args: dict[str, Any] | None = None):
        self.env_id = env_id
        self.env = load(env_id, env_args)
        self.turns = _Turns()
        self.rollout: asyncio.Task[Any] | None = None
        self.messages: list[dict[str, Any]] = []
        self.tools: list[dict[str, Any]] = []
        self.reply: asyncio.Future[dict[str, Any]] | None = None

    async def start(self, row: dict[str, Any]) -> Start:
        rollout_input = {"prompt": row["prompt"], "answer": row.get("answer") or "", "info": row.get("info") or {},
                         "task": row.get("task") or "default", "example_id": row.get("example_id", 0)}
        self.rollout = asyncio.get_running_loop().create_task(self._play(rollout_input))
        request = await self._next()
        if request is None:
            raise RuntimeError(f"verifiers environment {self.env_id!r} ended its rollout without asking the model "
                               f"for a turn")
        self.messages, self.tools = request["messages"], list(request.get("tools") or [])
        return Start(messages=[template_message(m) for m in self.messages], tools=self.tools)

    async def step(self, turn: Turn) -> Step:
        assert self.reply is not None, "start comes first"
        self.reply.set_result(completion(turn, MODEL))
        request = await self._next()
        if request is None:
            return self._scored()
        messages = request["messages"]
        known = len(self.messages)
        keys = [json.dumps(template_message(m), sort_keys=True) for m in messages[:known]]
        if (len(messages) <= known or keys != [json.dumps(template_message(m), sort_keys=True) for m in self.messages]
                or messages[known].get("role") != "assistant"):
            raise ValueError(f"verifiers environment {self.env_id!r} asked for turn {turn.index + 1} with messages "
                             f"that do not continue the conversation (its history rewritten); distrl trains an "
                             f"environment's episode as one conversation")
        if list(request.get("tools") or []) != self.tools:
            raise ValueError(f"verifiers environment {self.env_id!r} changed the tools offered during an episode")
        self.messages = messages
        return Step(messages=[template_message(m) for m in messages[known + 1:]])

    def close(self) -> None:
        if self.rollout is not None and not self.rollout.done():
            self.rollout.cancel()

    async def _play(self, rollout_input: dict[str, Any]) -> Any:
        import openai

        http = openai.DefaultAsyncHttpxClient(transport=self.turns)  # type: ignore[arg-type]  # a transport by protocol
        async with openai.AsyncOpenAI(base_url="http://distrl.episode/v1", api_key="distrl", max_retries=0,
                                      http_client=http) as client:
            return await self.env.run_rollout(rollout_input, client, MODEL, {})

    async def _next(self) -> dict[str, Any] | None:
        """The next chat completion the rollout asks for, or None when the rollout ended (its failure raised)."""
        assert self.rollout is not None
        asked = asyncio.ensure_future(self.turns.requests.get())
        done, _ = await asyncio.wait({asked, self.rollout}, return_when=asyncio.FIRST_COMPLETED)
        if asked in done:
            body, self.reply = asked.result()
            return body
        asked.cancel()
        self.rollout.result()  # raises the rollout's own failure
        return None

    def _scored(self) -> Step:
        assert self.rollout is not None
        output = self.rollout.result()
        error = output.get("error")
        if error is not None and error.get("error") not in MODEL_ERRORS:
            raise RuntimeError(f"verifiers environment {self.env_id!r} failed its rollout: "
                               f"{error.get('error_chain_str') or error}")
        metrics = {name: float(value) for name, value in (output.get("metrics") or {}).items()}
        metrics["error"] = float(error is not None)
        return Step(reward=float(output.get("reward") or 0.0), done=True, metrics=metrics)

