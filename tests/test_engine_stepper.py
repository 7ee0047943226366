"""The stepper's reading of vLLM's outputs (`EngineStepper._collect`) with hand-written outputs in vLLM's shape: the
sampled tokens come as deltas, and with `enable_return_routed_experts` the routes come whole with the finished output
(vLLM's `CompletionOutput.routed_experts`, `[n, L, k]`), which the turn carries (`Sampled.routes`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np

from distrl.workers.rollout.episodes import EngineStepper, _Request


def output(ids: list[int], finished: bool, routes=None):
    logprobs = SimpleNamespace(logprobs=[-0.5] * len(ids))
    completion = SimpleNamespace(token_ids=ids, logprobs=logprobs, text="", finish_reason="stop" if finished else None,
                                 routed_experts=routes)
    return SimpleNamespace(request_id="turn-0", prompt_token_ids=[1, 2, 3], outputs=[completion], finished=finished)


def test_a_finished_turn_carries_the_routes_the_engine_returned():
    loop = asyncio.new_event_loop()
    stepper = EngineStepper(None, lambda m, s: None, lambda: 4, decode=lambda ids: "text")
    stepper.requests["turn-0"] = request = _Request(loop.create_future())
    routes = np.arange(4 * 2 * 2, dtype=np.uint8).reshape(4, 2, 2)  # prompt 3 + sampled 2, but the last: 4 tokens
    stepper._collect(output([7], finished=False), 4)
    stepper._collect(output([8], finished=True, routes=routes), 4)
    turn = request.future.result()
    assert turn.token_ids == [7, 8] and turn.prompt_ids == [1, 2, 3] and turn.routes is routes
    loop.close()
