"""The producer's bookkeeping of partial rollouts (`loop.partial_rollouts`): every sample of every admitted group,
from its admission until its group is complete, as exactly one piece that is waiting, in flight or finished.

A group of `n` samples is admitted as `n` waiting pieces (empty responses). A chunk takes waiting pieces, oldest
ticket first, and sends their prefixes to an engine, which continues each by one slice
(`distrl.workers.rollout.slices`). What comes back replaces the piece: finished, or waiting again with its longer
prefix (carried over). A chunk lost with its engine puts its pieces back as they were sent: the tokens of the lost
slice are sampled again, those before it are kept. A group whose `n` pieces are finished leaves, whole, to be scored;
so a sample is handed on once (never trained twice) and every admitted sample is in exactly one place until then
(never lost).

Staleness per token: a group's `oldest` version is that of its oldest sampled token, or, before any token, the
version its prompt was admitted under (its tokens will be at least that new). A step that starts its update from
version u may not train a token older than u - k, so the producer waits for a group whose oldest token would be
too old for the next step (`due`) rather than let it go stale.

Resume: a checkpoint records the prompts consumed (trained or discarded), not pieces; a resumed run draws the
prompts of unfinished groups again and samples them anew from their prompts.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from distrl.types.prompt import Prompt
from distrl.types.rollouts import PARTIAL, Episode, Rollouts


@dataclass
class _Group:
    prompt: Prompt
    admitted: int  # the version of the weights pushed when its prompt was drawn
    finished: dict[int, Rollouts] = field(default_factory=dict)  # sample index -> its finished row
    prefixes: dict[int, Rollouts] = field(default_factory=dict)  # sample index -> waiting or in-flight row


@dataclass(frozen=True)
class Pieces:
    """Pieces sent together: `prefixes` (one row each) and their sample indices within their groups."""

    prefixes: Rollouts
    samples: list[int]

    def ids(self) -> list[tuple[int, int]]:
        return list(zip(self.prefixes.group, self.samples, strict=True))


class Carry:
    """Every admitted group of `n` samples until it is complete (see the module docstring)."""

    def __init__(self, n: int):
        self.n = n
        self.groups: dict[int, _Group] = {}  # ticket -> its open group
        self.waiting: list[tuple[int, int]] = []  # heap of (ticket, sample) not in flight and not finished
        self.in_flight: set[tuple[int, int]] = set()

    def __len__(self) -> int:
        """Open groups: admitted, not yet complete."""
        return len(self.groups)

    def admit(self, drawn: list[tuple[int, Prompt]], version: int) -> None:
        """Groups of the prompts `drawn` (ticket, prompt), admitted while weights of `version` are pushed."""
        for ticket, prompt in drawn:
            if ticket in self.groups:
                raise ValueError(f"prompt ticket {ticket} is admitted twice")
            group = self.groups[ticket] = _Group(prompt, version)
            for j in range(self.n):
                row = Rollouts.empty()
                row.add(list(prompt.prompt_ids), [], [], [], [], "", PARTIAL, ticket, Episode(), version)
                group.prefixes[j] = row
                heapq.heappush(self.waiting, (ticket, j))

    def take(self, limit: int) -> Pieces | None:
        """Up to `limit` waiting pieces, oldest ticket first, now in flight (None when none waits)."""
        keys = [heapq.heappop(self.waiting) for _ in range(min(limit, len(self.waiting)))]
        if not keys:
            return None
        self.in_flight.update(keys)
        return Pieces(Rollouts.concat([self.groups[t].prefixes[j] for t, j in keys]), [j for _, j in keys])

    def returned(self, sent: Pieces, rows: Rollouts) -> list[tuple[int, Prompt, Rollouts]]:
        """An engine's answer to `sent` (`rows[i]` continues piece i); returns the groups it completed: (ticket,
        prompt, its `n` rows in sample order), oldest ticket first."""
        if len(rows) != len(sent.prefixes):
            raise ValueError(f"{len(rows)} rows came back for {len(sent.prefixes)} pieces")
        complete: list[tuple[int, Prompt, Rollouts]] = []
        for i, key in enumerate(sent.ids()):
            ticket, j = key
            if rows.group[i] != ticket:
                raise ValueError(f"row {i} came back for ticket {rows.group[i]}; it was sent for ticket {ticket}")
            self.in_flight.remove(key)  # KeyError: a piece not in flight came back (sent twice)
            group, row = self.groups[ticket], rows.select([i])
            if row.finish_reasons[0] == PARTIAL:
                group.prefixes[j] = row
                heapq.heappush(self.waiting, key)
                continue
            del group.prefixes[j]
            group.finished[j] = row
            if len(group.finished) == self.n:
                del self.groups[ticket]
                complete.append((ticket, group.prompt, Rollouts.concat([group.finished[k] for k in range(self.n)])))
        return sorted(complete, key=lambda c: c[0])

    def lost(self, sent: Pieces) -> None:
        """`sent` was lost with its engine: its pieces wait again, with the prefixes they were sent with."""
        for key in sent.ids():
            self.in_flight.remove(key)
            heapq.heappush(self.waiting, key)

    def oldest(self, ticket: int) -> int:
        """The version of open group `ticket`'s oldest sampled token; its admission's before it has one."""
        group = self.groups[ticket]
        versions = [v for part in (*group.finished.values(), *group.prefixes.values())
                    for v in part.token_versions[0]]
        return min(versions, default=group.admitted)

    def due(self, step: int, k: int) -> list[int]:
        """Open groups (tickets, in order) that step `step + 1` could no longer train: their oldest token is already
        k versions behind step `step`'s update (version step - 1)."""
        return sorted(t for t in self.groups if step - 1 - self.oldest(t) >= k)

    def held_tokens(self) -> int:
        """Response tokens of open groups: carried over to a later batch."""
        return sum(len(part.response_ids[0]) for g in self.groups.values()
                   for part in (*g.finished.values(), *g.prefixes.values()))
