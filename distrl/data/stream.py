"""The prompt stream: the dataset's prompts, epoch after epoch, each draw identified by its ticket; deterministic
for a seed, and resumable while producers run ahead of training."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from distrl.types.prompt import Prompt

__all__ = ["PromptStream"]


class PromptStream:
    """The endless stream of prompts, epoch after epoch; every draw is identified by its ticket (its position in
    the stream).

    Ticket t is prompt `order_e[t mod N]` of epoch `e = t // N`, where epoch e visits every prompt once in the order
    `random.Random(seed * 1_000_003 + e)` shuffles them to (dataset order without `shuffle`): the stream depends
    only on (prompts, seed, shuffle). Draws may run ahead of training (asynchronous mode, dynamic sampling), so
    the state records what was *consumed* (trained on, or discarded by dynamic sampling or the staleness bound):
    a restored stream serves again exactly the prompts drawn but not consumed, and nothing consumed.
    """

    def __init__(self, prompts: list[Prompt], seed: int = 0, shuffle: bool = True):
        if not prompts:
            raise ValueError("PromptStream needs at least one prompt")
        self.prompts, self.seed, self.shuffle = list(prompts), seed, shuffle
        self._orders: dict[int, list[int]] = {}
        self._draw = 0  # next ticket to hand out
        self._low = 0  # every ticket below it is consumed
        self._consumed: set[int] = set()  # consumed tickets >= _low

    def epoch_of(self, ticket: int) -> int:
        return ticket // len(self.prompts)

    def prompt(self, ticket: int) -> Prompt:
        epoch = self.epoch_of(ticket)
        if epoch not in self._orders:
            order = list(range(len(self.prompts)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # tickets are drawn in order: one epoch's order at a time suffices
        return self.prompts[self._orders[epoch][ticket % len(self.prompts)]]

    def take(self, n: int) -> list[tuple[int, Prompt]]:
        """The next `n` (ticket, prompt) pairs, skipping tickets a restored state marks as consumed."""
        out: list[tuple[int, Prompt]] = []
        while len(out) < n:
            ticket, self._draw = self._draw, self._draw + 1
            if ticket not in self._consumed:
                out.append((ticket, self.prompt(ticket)))
        return out

    def consume(self, tickets: Iterable[int]) -> None:
        """Mark drawn tickets as consumed (trained on or discarded)."""
        self._consumed.update(t for t in tickets if t >= self._low)
        while self._low in self._consumed:
            self._consumed.remove(self._low)
            self._low += 1

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: the first unconsumed ticket, the consumed tickets beyond it, the dataset size."""
        return {"next": self._low, "consumed": sorted(self._consumed), "num_prompts": len(self.prompts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`: draws restart at the first unconsumed ticket. The dataset must have the
        same number of prompts."""
        if state["num_prompts"] != len(self.prompts):
            raise ValueError(f"cannot resume the prompt stream: the checkpoint saw {state['num_prompts']} prompts, "
                             f"the dataset now has {len(self.prompts)}")
        self._low = self._draw = int(state["next"])
        self._consumed = {int(t) for t in state["consumed"]}
