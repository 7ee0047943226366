"""`RoutingHFRolloutWorker`: the HF test rollout worker (`tests/hf_rollout.py`) returning routes as vLLM does with
`rollout.routing_replay` (which its CPU build cannot): for every sample, the experts each MoE layer routed each of its
tokens but the last to, recorded from the HF model's own forward pass over the sample (`Rollouts.routes`, uint8)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from distrl.types.prompt import Prompt
from distrl.types.rollouts import Rollouts
from distrl.workers.training import moe
from tests.hf_rollout import HFRolloutWorker


class RoutingHFRolloutWorker(HFRolloutWorker):
    def generate(self, prompts: list[Prompt], groups: list[int], sampling: Any = None) -> Rollouts:
        out = super().generate(prompts, groups, sampling)
        routes = [self._routes([*p, *r]) for p, r in zip(out.prompt_ids, out.response_ids, strict=True)]
        return replace(out, routes=routes).validate()

    @torch.no_grad()
    def _routes(self, ids: list[int]) -> np.ndarray:
        """`[len(ids) - 1, L, k]`: the experts the model routes each token but the last to."""
        kept: list[torch.Tensor] = []
        handles = [r.register_forward_hook(lambda module, args, output: kept.append(output[2]))
                   for r in moe.routers(self.model)]
        try:
            self.model(input_ids=torch.tensor([ids]))
        finally:
            for handle in handles:
                handle.remove()
        return torch.stack(kept, 1)[:-1].numpy().astype(np.uint8)
