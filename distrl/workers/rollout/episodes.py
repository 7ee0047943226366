"""`EngineStepper`: one in-process vLLM engine (`LLMEngine`, stepped) serving the turns of many episodes at once.

Every episode that has a turn to take has a request in the engine, and each engine step advances all of them
(continuous batching); an episode waiting on its environment has none, so it costs no engine time. Episodes are
asyncio tasks on the rollout worker's event loop; the stepper runs between them, yielding after every step so that
environment calls progress. Each step's time is shared among the requests it advanced (each episode's
`engine_s`: what it cost the engine). Outputs come as deltas, so each sampled token is stamped with the policy
version the engine served at the step that sampled it. The synchronous engine is stepped rather than `AsyncLLM`
because it keeps the engine core in this process, where weights are reloaded in place (see
`distrl.workers.rollout.worker`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from distrl.agents.trajectory import Sampled


@dataclass
class _Request:
    future: asyncio.Future
    prompt_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    engine_s: float = 0.0  # this request's share of the engine steps that advanced it


class EngineStepper:
    """Samples turns on `engine` (a vLLM `LLMEngine`), for every episode of every generation call in flight; lives
    as long as its worker, on the engine's thread (`distrl.workers.rollout.engine_loop`). `make_params(max_tokens,
    seed)` builds a request's `SamplingParams`; `version()` is the policy version served now; `decode(ids)` gives a
    turn's text where the engine did not detokenize; `adapter()` is the `LoRARequest` of the adapters served now (None
    without `learner.lora`)."""

    def __init__(self, engine: Any, make_params: Callable[[int, int], Any], version: Callable[[], int],
                 decode: Callable[[list[int]], str], adapter: Callable[[], Any] = lambda: None):
        self.engine, self.make_params, self._version, self.decode = engine, make_params, version, decode
        self.adapter = adapter  # the LoRARequest every new request carries (None: the engine's own weights)
        self.admitting = asyncio.Event()  # cleared while adapters are swapped: new turns wait (`drain`)
        self.admitting.set()
        self.drained = asyncio.Event()  # set whenever no request is in the engine
        self.drained.set()
        self.requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._closing = False
        self.error: Exception | None = None

    @property
    def version(self) -> int:
        return self._version()

    async def sample(self, prompt_ids: list[int], max_tokens: int, seed: int,
                     make_params: Callable[[int, int], Any] | None = None) -> Sampled:
        """One turn; `make_params` (max_tokens, seed) -> `SamplingParams` stands in for the worker's own (an
        evaluation's settings)."""
        from vllm.inputs import TokensPrompt

        if self.error is not None:
            raise RuntimeError(f"the engine failed earlier: {self.error}") from self.error
        await self.admitting.wait()
        request_id = f"turn-{next(self._ids)}"
        request = _Request(asyncio.get_running_loop().create_future())
        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt_ids)),
                                (make_params or self.make_params)(max_tokens, seed), lora_request=self.adapter())
        self.requests[request_id] = request
        self.drained.clear()
        self._wake.set()
        try:
            return await request.future
        except asyncio.CancelledError:  # its episode was given up (another episode of its call failed)
            if self.requests.pop(request_id, None) is not None:
                self.engine.abort_request([request_id])
            raise

    async def run(self) -> None:
        """Step the engine while requests are waiting, until `close()`. An engine error fails every waiting turn
        and every later one (the worker cannot serve any more)."""
        while True:
            if not self.requests:
                self.drained.set()
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            began = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as err:  # noqa: BLE001 - it reaches every waiting turn, and every later one, which raise it
                self.error = err
                for request in self.requests.values():
                    request.future.set_exception(err)
                self.requests.clear()
                self.drained.set()
                return
            share = (time.perf_counter() - began) / len(self.requests)
            for request in self.requests.values():
                request.engine_s += share
            version = self.version
            for out in outputs:
                self._collect(out, version)
            await asyncio.sleep(0)  # episodes whose turn finished, environment calls and other work run now

    async def drain(self) -> None:
        """Return once no request is in the engine, admitting none meanwhile (turns in flight finish; new turns wait
        in `sample` until `admit`)."""
        self.admitting.clear()
        await self.drained.wait()

    def admit(self) -> None:
        """Let the turns waiting since `drain` into the engine."""
        self.admitting.set()

    @property
    def in_flight(self) -> int:
        """Requests in the engine now."""
        return len(self.requests)

    def _collect(self, out: Any, version: int) -> None:
        request = self.requests.get(out.request_id)
        if request is None:  # aborted while this step ran
            return
        if request.prompt_ids is None and out.prompt_token_ids is not None:
            request.prompt_ids = list(out.prompt_token_ids)
        completion = out.outputs[0]
        new = list(completion.token_ids)
        request.token_ids += new
        if completion.logprobs is not None:
            request.logprobs += list(completion.logprobs.logprobs)[-len(new):] if new else []
        request.versions += [version] * len(new)
        request.text += completion.text or ""
        if out.finished:
            del self.requests[out.request_id]
            if len(request.logprobs) != len(request.token_ids):
                request.future.set_exception(RuntimeError(
                    f"vLLM returned {len(request.logprobs)} log-probs for a turn of {len(request.token_ids)} "
                    f"tokens; expected one per sampled token"))
                return
            text = request.text if request.text else self.decode(request.token_ids)
            # vLLM's routes (`enable_return_routed_experts`) come whole with the finished output: [n, L, k].
            request.future.set_result(Sampled(request.prompt_ids or [], request.token_ids, request.logprobs,
                                              request.versions, text, completion.finish_reason or "length",
                                              request.engine_s, getattr(completion, "routed_experts", None)))

    def close(self) -> None:
        """`run` returns once no request is left."""
        self._closing = True
        self._wake.set()


class Resampled:
    """`stepper`'s turns with other sampling settings (`make_params`): an evaluation's episodes share the engine
    with training's."""

    def __init__(self, stepper: EngineStepper, make_params: Callable[[int, int], Any]):
        self.stepper, self.make_params = stepper, make_params

    @property
    def version(self) -> int:
        return self.stepper.version

    async def sample(self, prompt_ids: list[int], max_tokens: int, seed: int) -> Sampled:
        return await self.stepper.sample(prompt_ids, max_tokens, seed, self.make_params)
