"""A small hand-written rollout worker for unit tests of the loop: samples from the HF model with plain torch, in
the driver's process, with the same interface as `distrl.workers.rollout.worker.RolloutWorker` (no vLLM).

Log-probs are those of the distribution sampled from (temperature applied), like vLLM's processed log-probs, and
in float32 with the learner's own forward pass, so with the same weights they equal the learner's. Each prompt is
sampled with its own generator, seeded like vLLM's requests (`request_seed`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import torch

from distrl.agents.chat import ChatRenderer
from distrl.agents.episode import EnvClient, EpisodeRunner, as_rollouts
from distrl.agents.host import EnvHost
from distrl.agents.tool_calls import ToolCallParser
from distrl.agents.trajectory import Budget, Sampled
from distrl.config import EnvConfig, LoraConfig, ModelConfig, RolloutConfig
from distrl.types.prompt import Prompt
from distrl.types.rollouts import Episode, Rollouts
from distrl.workers.model_files import DTYPES, load_tokenizer
from distrl.workers.rollout.sampling import eval_sampling, request_seed
from distrl.workers.rollout.slices import continue_samples
from distrl.workers.training import lora as adapters
from distrl.workers.training.model import load_causal_lm
from distrl.workers.weights.fingerprint import Fingerprint, Region, add, check, of_tensors
from distrl.workers.weights.pieces import BucketParts, assemble


class HFRolloutWorker:
    def __init__(self, cfg: RolloutConfig, model: ModelConfig, max_prompt_tokens: int, seed: int,
                 num_gpus: float = 0.0, environment: EnvConfig | None = None, envs: EnvClient | None = None,
                 max_restarts: int = 0, address: Any = None, max_new_tokens: int | None = None,
                 lora: LoraConfig | None = None, exit_when_lost: bool = False):
        self.cfg, self.lora = cfg, lora
        self.model = load_causal_lm(model, "float32")
        if lora is not None:  # the pushed adapters on the frozen base, as vLLM serves them
            self.model = adapters.wrap(self.model, lora)
        self.model.requires_grad_(False)
        self.tokenizer = load_tokenizer(model)
        self.seed = seed
        self.policy_version = 0
        self.calls = 0  # generate calls served, for tests of the dispatch
        self.runner: EpisodeRunner | None = None
        if environment is not None:  # multi-turn episodes through distrl's own runner, sampled here
            e = environment
            if e.agent is not None:
                raise ValueError("the HF test worker runs environment classes (env.class), not agent functions")
            budget = Budget.of(cfg.sampling.max_new_tokens, e, self.model.config.max_position_embeddings)
            parser = None if e.tool_parser is None else ToolCallParser(e.tool_parser, self.tokenizer)
            self.runner = EpisodeRunner(HFSampler(self), ChatRenderer(self.tokenizer), budget,
                                        envs or EnvHost(e.cls, e.kwargs, e.step_timeout_s, e.on_error), parser,
                                        self.tokenizer.eos_token_id, max_restarts)

    @torch.no_grad()
    def _sample(self, prompt_ids: list[int], n: int, seed: int, max_tokens: int | None = None,
                sampling: Any = None) -> tuple[list[list[int]], list[list[float]], list[str]]:
        s = sampling or self.cfg.sampling
        generator = torch.Generator().manual_seed(seed)
        ids = torch.tensor([prompt_ids] * n)
        alive = torch.ones(n, dtype=torch.bool)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        reasons = ["length"] * n
        for _ in range(max_tokens or s.max_new_tokens):
            logits = self.model(input_ids=ids).logits[:, -1].float()
            if s.temperature == 0:  # greedy (an evaluation's)
                logp = torch.log_softmax(logits, -1)
                next_ids = logits.argmax(-1)
            else:
                logp = torch.log_softmax(logits / s.temperature, -1)
                next_ids = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
            for i in range(n):
                if alive[i]:
                    tokens[i].append(int(next_ids[i]))
                    logprobs[i].append(float(logp[i, next_ids[i]]))
                    if int(next_ids[i]) == self.tokenizer.eos_token_id:
                        alive[i], reasons[i] = False, "stop"
            if not alive.any():
                break
            ids = torch.cat([ids, next_ids[:, None]], dim=1)
        return tokens, logprobs, reasons

    def generate(self, prompts: list[Prompt], groups: list[int], sampling: Any = None) -> Rollouts:
        self.calls += 1
        if self.runner is not None:
            if sampling is not None:
                raise ValueError("the HF test worker evaluates one-turn jobs only")
            return asyncio.run(self._episodes(self.runner, prompts, groups))
        s = eval_sampling(self.cfg.sampling, sampling) if sampling is not None else None
        n = sampling.n if sampling is not None else self.cfg.n_samples_per_prompt
        out = Rollouts.empty()
        for prompt, group in zip(prompts, groups, strict=True):
            tokens, logprobs, reasons = self._sample(prompt.prompt_ids, n, request_seed(self.seed, group),
                                                     s.max_new_tokens if s else None, s)
            for ids, lps, reason in zip(tokens, logprobs, reasons, strict=True):
                v = self.policy_version
                out.add(list(prompt.prompt_ids), ids, lps, [1] * len(ids), [v] * len(ids),
                        self.tokenizer.decode(ids, skip_special_tokens=True), reason, group, Episode(), v)
        return out.validate()

    def continue_samples(self, prefixes: Rollouts, samples: list[int], slice_tokens: int) -> Rollouts:
        self.calls += 1
        budget = Budget.of(self.cfg.sampling.max_new_tokens, None, self.model.config.max_position_embeddings)
        seeds = [request_seed(self.seed, ticket) for ticket in prefixes.group]
        return asyncio.run(continue_samples(HFSampler(self), budget, prefixes, samples, seeds, slice_tokens,
                                            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)))

    async def _episodes(self, runner: EpisodeRunner, prompts: list[Prompt], groups: list[int]) -> Rollouts:
        n = self.cfg.n_samples_per_prompt
        results = [await runner.run(f"{g}.{j}", p.prompt_ids, p.row(), request_seed(self.seed, g), j)
                   for p, g in zip(prompts, groups, strict=True) for j in range(n)]
        return as_rollouts(results, groups, n, self.policy_version)

    def load_weights(self, version: int, buckets: Iterable[BucketParts]) -> int:
        state = {name: t.float() for bucket in buckets for name, t in assemble(bucket).items()}
        if self.lora is not None:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, state)
        else:
            self.model.load_state_dict(state, strict=False)
        self.policy_version = version
        return version

    def _served(self) -> Iterable[tuple[str, torch.Tensor]]:
        dtype = DTYPES[self.cfg.dtype]
        return (adapters.served_tensors(adapters.adapter_tensors(self.model), dtype, self.lora.scaling)
                if self.lora is not None else self.model.state_dict().items())

    def weight_regions(self) -> dict[str, list[Region]]:
        return {name: [None] for name, _ in self._served()}  # one worker, every tensor whole

    def check_weights(self, version: int, name: str, *expected: Fingerprint) -> int:
        check(add(expected), of_tensors(self._served(), DTYPES[self.cfg.dtype]), name, version)
        return version


class HFSampler:
    """The episode runner's sampler over an HFRolloutWorker: one sample per turn, seeded like a vLLM request."""

    def __init__(self, worker: HFRolloutWorker):
        self.worker = worker

    @property
    def version(self) -> int:
        return self.worker.policy_version

    async def sample(self, prompt_ids: list[int], max_tokens: int, seed: int) -> Sampled:
        tokens, logprobs, reasons = self.worker._sample(prompt_ids, 1, seed, max_tokens)
        v = self.worker.policy_version
        return Sampled(list(prompt_ids), tokens[0], logprobs[0], [v] * len(tokens[0]),
                       self.worker.tokenizer.decode(tokens[0], skip_special_tokens=True), reasons[0])
