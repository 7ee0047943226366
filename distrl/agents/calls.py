"""One agent episode's chat-completion calls, assembled into token-exact sequences.

An agent written against the OpenAI API sends whole conversations: each call carries every message so far. distrl
never re-tokenizes what it already has. A call whose messages are an earlier call's messages, then the reply
distrl gave it, then new messages (tool results, the user's words) *continues* that call's sequence: its prompt is
that sequence's ids (the prompt, the sampled ids with their end-of-turn token) and the new messages rendered by the
chat template as a delta, exactly as `distrl.agents.episode` builds an environment's turns. Any other call (a
conversation rewritten, summarised, or started afresh) begins a sequence of its own, rendered whole; each sequence
is one sample to train on (`Episode.segment`), and every one after the first counts as a non-continuation.

Messages are compared as the chat template sees them: roles, text, and tool calls by name and decoded arguments
(an agent that re-serialises arguments with other spacing, or drops a null content, still continues).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from distrl.agents.chat import ChatRenderer, ChatTemplateError
from distrl.agents.tool_calls import ToolCallParser
from distrl.agents.trajectory import Budget, EpisodeResult, Trajectory, TurnSampler, drift, turn_seed
from distrl.types.rollouts import Episode

UNSERVED = ("stop", "response_format", "logit_bias", "guided_json", "guided_regex")
"""Request fields that would change what is sampled, which distrl cannot honour and train on faithfully: refused
by name rather than ignored. Sampling fields (`temperature`, `top_p`, `seed`, ...) are ignored, documented."""


class CallRefused(Exception):
    """A call distrl does not serve: `status` is the HTTP status, the message says why. A call past an episode's
    budget is refused with `budget` set (the episode is recorded as cut for that reason)."""

    def __init__(self, status: int, message: str, budget: str | None = None):
        super().__init__(message)
        self.status, self.budget = status, budget


def _text(content: Any) -> str:
    """A message's content as text: a string, null, or a list of parts whose text parts are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise CallRefused(400, f"only text content parts are served, got {part!r}")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise CallRefused(400, f"a message's content must be a string or a list of text parts, got {content!r}")


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """`message` as the chat template takes it: text content, and tool calls' arguments decoded (transformers'
    layout: templates serialise the arguments themselves). Raises CallRefused for a message without a role."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise CallRefused(400, f"every message needs a 'role', got {message!r}")
    out: dict[str, Any] = {"role": message["role"], "content": _text(message.get("content"))}
    if message.get("name") is not None:
        out["name"] = message["name"]
    calls = message.get("tool_calls") or []
    if calls:
        if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                  and isinstance(c["function"].get("name"), str) for c in calls):
            raise CallRefused(400, f"a message's tool_calls must be a list of {{'function': {{'name', "
                                   f"'arguments'}}}}, got {calls!r}")
        out["tool_calls"] = [{"type": "function", "id": c.get("id", ""),
                              "function": {"name": c["function"]["name"],
                                           "arguments": _arguments(c["function"].get("arguments"))}}
                             for c in calls]
    if message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _key(message: dict[str, Any]) -> tuple:
    """What decides a message's tokens: its role, text (and name), and tool calls by name and arguments; ids that
    agents invent (tool-call ids) do not count."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in message.get("tool_calls", []))
    return message["role"], message["content"], message.get("name"), calls


@dataclass
class _Sequence:
    """One sequence of the episode: its trajectory, the conversation as the template sees it (ending with distrl's
    last reply), the tools it offers, and whether a call on it is in flight."""

    trajectory: Trajectory
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    busy: bool = False
    finish: str = "length"
    texts: list[str] = field(default_factory=list)


@dataclass
class _Tally:
    calls: int = 0
    tool_calls: int = 0
    parse_errors: int = 0
    engine_s: float = 0.0
    drift: int = 0
    in_calls_s: float = 0.0


class AgentCalls:
    """Serves one episode's calls on `sampler`: the seed of its j-th call is `turn_seed(seed, sample, j)`, as an
    environment episode's j-th turn. `budget`: `max_turns` bounds the episode's calls, `max_tokens` and the context
    each sequence's length; `parser` (optional) finds tool calls in replies."""

    def __init__(self, sampler: TurnSampler, chat: ChatRenderer, budget: Budget, parser: ToolCallParser | None,
                 end_of_turn: int | None, seed: int, sample: int):
        self.sampler, self.chat, self.budget, self.parser = sampler, chat, budget, parser
        self.end_of_turn, self.seed, self.sample = end_of_turn, seed, sample
        self.sequences: list[_Sequence] = []
        self.tally = _Tally()
        self.cut: str | None = None
        self.failure: Exception | None = None  # the engine's error while serving a call
        self.closed = False

    async def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        """The chat completion (OpenAI's `chat.completion` object) answering `request` (its JSON body)."""
        if self.closed:
            raise CallRefused(409, "this episode has ended")
        messages, tools, max_tokens = self._read(request)
        if self.tally.calls >= self.budget.max_turns:
            self.cut = self.cut or "max_turns"
            raise CallRefused(400, f"the episode made env.max_turns = {self.budget.max_turns} calls already",
                              "max_turns")
        try:
            seq, prompt_ids = self._sequence(messages, tools)
        except ChatTemplateError as err:
            raise CallRefused(400, f"the messages cannot be rendered by the model's chat template: {err}") from err
        seq.busy = True
        try:
            over = self._over(prompt_ids, seq)
            if over:
                self.cut = self.cut or over
                raise CallRefused(400, f"the episode's sequence reached its {over} budget", over)
            room = min(max_tokens, self.budget.max_new_tokens,
                       self.budget.max_tokens - (len(prompt_ids) - len(seq.trajectory.prompt_ids)),
                       self.budget.context - len(prompt_ids))
            index = self.tally.calls
            self.tally.calls += 1
            began = time.perf_counter()
            try:
                turn = await self.sampler.sample(prompt_ids, room, turn_seed(self.seed, self.sample, index))
            except Exception as err:
                self.failure = err  # the engine's, not the agent's: the episode raises it (see EpisodeRunner._agent)
                raise
            self.tally.in_calls_s += time.perf_counter() - began
        finally:
            seq.busy = False
        if self.closed:
            raise CallRefused(409, "this episode ended while the call ran")
        if not any(s is seq for s in self.sequences):  # a new sequence counts once it has a turn
            self.sequences.append(seq)
        traj = seq.trajectory
        if len(prompt_ids) > len(traj.ids):
            traj.add_observation(prompt_ids[len(traj.ids):], self.sampler.version)
        self.tally.drift += drift(turn.prompt_ids, traj.ids)
        self.tally.engine_s += turn.engine_s
        traj.add_turn(turn)
        seq.finish = turn.finish_reason
        seq.texts.append(turn.text)
        content, calls, parse_error = (self.parser.parse(turn.text) if self.parser is not None
                                       else (turn.text, [], None))
        self.tally.tool_calls += len(calls)
        self.tally.parse_errors += parse_error is not None
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = [{"type": "function", "id": c.id or f"call_{index}_{i}",
                                    "function": {"name": c.name, "arguments": c.arguments}}
                                   for i, c in enumerate(calls)]
        seq.messages = [*messages, reply]
        return self._completion(request, index, reply, turn, prompt_ids, bool(request.get("logprobs")))

    def _read(self, request: dict[str, Any]) -> tuple[list[dict], list[dict], int]:
        if request.get("stream"):
            raise CallRefused(400, "streaming is not served: call with stream=False")
        for name in UNSERVED:
            if request.get(name):
                raise CallRefused(400, f"'{name}' is not served: the job samples with rollout.sampling, and a "
                                       f"turn ends at the end-of-turn token or max_tokens")
        if request.get("n", 1) != 1:
            raise CallRefused(400, "n must be 1: the job runs each prompt's agent rollout.n_samples_per_prompt times")
        raw = request.get("messages")
        if not isinstance(raw, list) or not raw:
            raise CallRefused(400, "'messages' must be a non-empty list")
        messages = [template_message(m) for m in raw]
        tools = request.get("tools") or []
        limit = request.get("max_completion_tokens") or request.get("max_tokens") or self.budget.max_new_tokens
        if not isinstance(limit, int) or limit < 1:
            raise CallRefused(400, f"max_tokens must be a positive integer, got {limit!r}")
        return messages, tools, limit

    def _sequence(self, messages: list[dict], tools: list[dict]) -> tuple[_Sequence, list[int]]:
        """The sequence `messages` continue and the call's prompt ids; a new sequence when they continue none."""
        keys = [_key(m) for m in messages]
        for seq in sorted(self.sequences, key=lambda s: -len(s.messages)):
            n = len(seq.messages)
            if seq.busy or tools != seq.tools or len(keys) <= n or keys[:n] != [_key(m) for m in seq.messages]:
                continue
            added = messages[n:]
            if any(m["role"] == "assistant" for m in added):
                continue  # the agent wrote a turn of its own: not what the model sampled
            traj = seq.trajectory
            closed = seq.finish != "length"
            end = traj.response_ids[-1] if closed else self.end_of_turn
            if end is None:
                continue  # a reply cut by max_tokens cannot be closed without the end-of-turn token
            observation = ([] if closed else [end]) + self.chat.observation_ids(added, tools, end)
            return seq, [*traj.ids, *observation]
        prompt_ids = self.chat.prompt_ids(messages, tools)
        return _Sequence(Trajectory(prompt_ids), messages, tools), prompt_ids

    def _over(self, prompt_ids: list[int], seq: _Sequence) -> str | None:
        if len(prompt_ids) >= self.budget.context:
            return "context"
        if len(prompt_ids) - len(seq.trajectory.prompt_ids) >= self.budget.max_tokens:
            return "max_tokens"
        return None

    def _completion(self, request: dict[str, Any], index: int, reply: dict[str, Any], turn: Any,
                    prompt_ids: list[int], logprobs: bool) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply["content"] or None}
        if "tool_calls" in reply:
            message["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["function"]["name"],
                                                   "arguments": json.dumps(c["function"]["arguments"])}}
                                     for c in reply["tool_calls"]]
        finish = "tool_calls" if "tool_calls" in reply else turn.finish_reason
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None,
                                  "token_ids": list(turn.token_ids)}
        if logprobs:
            pieces = [self.chat.tokenizer.decode([t]) for t in turn.token_ids]
            choice["logprobs"] = {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()),
                                               "top_logprobs": []}
                                              for p, lp in zip(pieces, turn.logprobs, strict=True)]}
        return {"id": f"chatcmpl-{self.seed}-{self.sample}-{index}", "object": "chat.completion",
                "created": int(time.time()), "model": request.get("model") or "distrl", "choices": [choice],
                "prompt_token_ids": list(prompt_ids),
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(turn.token_ids),
                          "total_tokens": len(prompt_ids) + len(turn.token_ids)}}

    def results(self, reward: float, prompt_ids: list[int], wall_s: float) -> list[EpisodeResult]:
        """The episode's sequences as samples (in the order their first calls returned), each with reward
        `reward`; the first carries the episode's figures. An agent that made no call gives one empty sample of
        prompt `prompt_ids`. `wall_s`: the agent's time, of which what its calls did not take is counted as waiting
        on it."""
        self.closed = True
        t = self.tally
        first = Episode(turns=t.calls, tool_calls=t.tool_calls, parse_errors=t.parse_errors,
                        env_wait_s=max(0.0, wall_s - t.in_calls_s), engine_s=t.engine_s, reward=reward,
                        cut=self.cut, drift=t.drift,
                        template_drift=any(self.chat.template_drift(s.messages, s.tools, s.trajectory.ids)
                                           for s in self.sequences))
        if not self.sequences:
            return [EpisodeResult(Trajectory(prompt_ids), "", "length", first)]
        return [EpisodeResult(s.trajectory, "".join(s.texts), s.finish,
                              first if k == 0 else Episode(turns=0, reward=reward, segment=k))
                for k, s in enumerate(self.sequences)]
