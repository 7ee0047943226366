"""Held-out evaluation: episodes of a model against the job's own environment, through distrl's episode runner
(the same prompts, tool-call parsing, observations and budgets as training), sampled with HF `generate` at the
training temperature. Greedy decoding would only show the more likely of the warm start's two behaviours (calling
the tool, or a guess whose first digit is one of ten), not how often the policy calls the tool.

Figures over the held-out rows:
  reward          mean episode reward (1 for the right final answer)
  tool_use        episodes whose calculator call computes the row's answer (the call is right, whatever follows)
  called          episodes with at least one tool call
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distrl.agents.chat import ChatRenderer
from distrl.agents.episode import EpisodeRunner
from distrl.agents.host import EnvHost
from distrl.agents.tool_calls import ToolCallParser
from distrl.agents.tools.calculator import evaluate as calculate
from distrl.agents.trajectory import Budget, Sampled
from distrl.config import Config


class BatchedSampler:
    """The episode runner's sampler over an HF model: the turns that episodes ask for within `wait_s` of each other
    are sampled together in one `generate` call (left-padded), at `temperature` (0: greedy). The randomness is one
    stream seeded by `seed` and advanced per call, not the episodes' own seeds: an evaluation is reproducible as a
    whole. Log-probs are not needed here and are left at 0."""

    version = 0

    def __init__(self, model: Any, tokenizer: Any, temperature: float, seed: int, wait_s: float = 0.01):
        self.model, self.tokenizer, self.temperature, self.wait_s = model, tokenizer, temperature, wait_s
        self.generator_seed = seed
        self.pending: list[tuple[list[int], int, asyncio.Future]] = []

    async def sample(self, prompt_ids: list[int], max_tokens: int, seed: int) -> Sampled:
        future = asyncio.get_running_loop().create_future()
        if not self.pending:
            asyncio.get_running_loop().call_later(self.wait_s, self._flush)
        self.pending.append((list(prompt_ids), max_tokens, future))
        tokens = await future
        eos = self.tokenizer.eos_token_id
        return Sampled(list(prompt_ids), tokens, [0.0] * len(tokens), [0] * len(tokens),
                       self.tokenizer.decode(tokens, skip_special_tokens=True),
                       "stop" if tokens and tokens[-1] == eos else "length")

    def _flush(self) -> None:
        batch, self.pending = self.pending, []
        try:
            self._generate(batch)
        except Exception as err:  # noqa: BLE001 - each waiting episode raises it (a loop callback cannot)
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(err)

    def _generate(self, batch: list) -> None:
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        width = max(len(ids) for ids, _, _ in batch)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _, _ in batch])
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _, _ in batch])
        torch.manual_seed(self.generator_seed)
        self.generator_seed += 1
        sampling = (dict(do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0) if self.temperature > 0
                    else dict(do_sample=False))
        with torch.no_grad():
            out = self.model.generate(input_ids, attention_mask=attention_mask,
                                      max_new_tokens=max(n for _, n, _ in batch), eos_token_id=eos,
                                      pad_token_id=pad, **sampling)
        for row, (_, max_tokens, future) in zip(out[:, width:].tolist(), batch, strict=True):
            tokens = row[:max_tokens]
            if eos in tokens:
                tokens = tokens[:tokens.index(eos) + 1]
            future.set_result(tokens)


@dataclass
class Evaluation:
    reward: float
    tool_use: float
    called: float
    n: int


def right_call(parser: ToolCallParser, text: str, answer: str) -> bool:
    """Whether `text` (an episode's turns) holds a calculator call whose expression computes `answer`."""
    _, calls, _ = parser.parse(text)
    for call in calls:
        expression = call.arguments.get("expression")
        if call.name == "calculator" and isinstance(expression, str):
            try:
                value = calculate(expression)
            except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError):
                continue
            if abs(value - float(answer)) < 1e-6:
                return True
    return False


def evaluate(cfg: Config, model_dir: str | Path, rows: list[dict[str, Any]], temperature: float = 1.0,
             seed: int = 0) -> Evaluation:
    """Episodes of the model at `model_dir` on `rows` in `cfg.env`'s environment and budgets, sampled at
    `temperature` (0: greedy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert cfg.env is not None and cfg.env.tool_parser is not None, "the calculator job has an env with tool calls"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    env = cfg.env
    parser = ToolCallParser(env.tool_parser, tokenizer)
    runner = EpisodeRunner(BatchedSampler(model, tokenizer, temperature, seed), ChatRenderer(tokenizer),
                           Budget.of(cfg.rollout.sampling.max_new_tokens, env, model.config.max_position_embeddings),
                           EnvHost(env.cls, env.kwargs, env.step_timeout_s, env.on_error), parser,
                           tokenizer.eos_token_id)

    async def episodes():
        return await asyncio.gather(*(runner.run(f"eval.{i}", [], row, 0, 0) for i, row in enumerate(rows)))

    results = [first for first, *_ in asyncio.run(episodes())]  # an environment's episode is one sequence
    n = len(rows)
    return Evaluation(reward=sum(r.episode.reward or 0.0 for r in results) / n,
                      tool_use=sum(right_call(parser, r.text, row["answer"]) for r, row in zip(results, rows,
                                                                                              strict=True)) / n,
                      called=sum(r.episode.tool_calls > 0 for r in results) / n, n=n)
