"""Episodes of an environment driven by scripted model turns (text, tokenized by the tiny model's tokenizer),
through distrl's own episode runner, chat template deltas, vLLM's tool-call parser and environment host: what the
adapters do without an engine, in a second."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from distrl.agents.chat import ChatRenderer
from distrl.agents.episode import EpisodeRunner
from distrl.agents.host import EnvHost
from distrl.agents.tool_calls import ToolCallParser
from distrl.agents.trajectory import TURN_STRIDE, Budget, EpisodeResult, Sampled

BUDGET = Budget(max_turns=6, max_tokens=400, context=1024, max_new_tokens=100)


class Turns:
    """A sampler whose k-th turn of each episode is `texts[k]` (the same script for every episode), tokenized,
    with the tokenizer's end-of-turn token; it records the prompts it was given, and calls `before_turn(k)` (when
    given) before it answers with turn k (a fault injected between two steps)."""

    version = 0

    def __init__(self, tokenizer: Any, texts: list[str], before_turn: Callable[[int], None] | None = None):
        self.tokenizer, self.texts, self.before_turn = tokenizer, texts, before_turn
        self.prompts: dict[int, list[list[int]]] = {}

    async def sample(self, prompt_ids: list[int], max_tokens: int, seed: int) -> Sampled:
        asked = self.prompts.setdefault(seed % TURN_STRIDE, [])  # turn_seed's base + sample: per episode
        asked.append(list(prompt_ids))
        if self.before_turn is not None:
            self.before_turn(len(asked) - 1)
        text = self.texts[min(len(asked) - 1, len(self.texts) - 1)]
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        return Sampled(list(prompt_ids), ids, [-1.0] * len(ids), [self.version] * len(ids), text, "stop")


def play(tokenizer: Any, spec: str, kwargs: dict[str, Any], rows: list[dict[str, Any]], texts: list[str],
         budget: Budget = BUDGET, timeout_s: float = 30.0, on_error: str = "raise",
         tool_parser: str | None = "hermes", before_turn: Callable[[int], None] | None = None) -> list[EpisodeResult]:
    """One episode per row, all at once, of environment `spec` with `kwargs`, the model's turns `texts` (and
    `before_turn`, see `Turns`)."""
    host = EnvHost(spec, kwargs, timeout_s, on_error)  # type: ignore[arg-type]
    parser = ToolCallParser(tool_parser, tokenizer) if tool_parser else None
    runner = EpisodeRunner(Turns(tokenizer, texts, before_turn), ChatRenderer(tokenizer), budget, host, parser,
                           tokenizer.eos_token_id)

    async def episodes() -> list[list[EpisodeResult]]:
        return await asyncio.gather(*(runner.run(f"ep.{i}", [], row, seed=100 * i, sample=0)
                                      for i, row in enumerate(rows)))

    return [first for first, *_ in asyncio.run(episodes())]


def call(name: str, **arguments: Any) -> str:
    """A turn that calls tool `name` in the tiny model's (Hermes) format."""
    import json

    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'
