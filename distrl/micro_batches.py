"""Micro-batch formation: which rows of a (mini-)batch go through one forward pass together. Pure Python, no Ray.

Two policies, both returning row-index groups so that a caller can reassemble per-row outputs in the original
order (`out[group] = f(batch.select(group))`):

- a fixed count (`micro_batch_size` consecutive rows), today's behaviour;
- a token budget (`max_tokens`): every micro-batch holds at most `max_tokens` real tokens (a longer row goes
  alone), in as few micro-batches as first-fit decreasing finds (never more than 11/9 of the fewest possible,
  plus one), then balanced: the rows dealt again, longest first, to the micro-batch with the fewest tokens. A
  packed forward pass costs about its token count, so few, full micro-batches make few passes with large matrix
  products, and balanced ones no small last pass; a batch of short responses runs in few large passes. The
  partition is deterministic (ties keep row order).

The loss of each micro-batch is divided by global token and sequence counts, so any partition of the rows gives
the same total loss and gradient: the choice only changes speed and memory.

Sharded (FSDP) learners run each forward pass as a collective, so every learner must run the same number of
micro-batches: `min_count` (the maximum count over learners, all-reduced by the caller) makes the partition have
at least that many groups, splitting the largest groups first and adding empty groups when no group has two rows
left. An empty group is an empty micro-batch whose forward pass the caller still runs (`response_logprobs` on zero
rows runs the model on one token and returns `[0, T]`, connected to the graph, so its backward joins the
collectives too).
"""

from __future__ import annotations

from collections.abc import Sequence


def fixed_count(num_rows: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of `micro_batch_size` rows (the last may be shorter)."""
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size}")
    return [list(range(i, min(i + micro_batch_size, num_rows))) for i in range(0, num_rows, micro_batch_size)]


def token_budget(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Groups of rows whose `lengths` (real tokens per row) add up to at most `max_tokens` (a row longer than that
    is a group of its own), as few as first-fit decreasing finds, then balanced: the rows dealt again, longest
    first, each to the group with the fewest tokens so far, over that many groups or the fewest more that keep
    every group within the budget (`balanced`). Groups are listed longest first, rows in each in ascending order."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_micro_batch must be > 0, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: equal lengths keep row order
    loads: list[int] = []
    for i in order:  # first-fit decreasing: how many groups the budget needs
        slot = next((g for g, load in enumerate(loads) if load + lengths[i] <= max_tokens), None)
        if slot is None:
            loads.append(lengths[i])
        else:
            loads[slot] += lengths[i]
    limit = max(max_tokens, max(lengths, default=0))  # a longer row goes alone
    for count in range(len(loads), len(lengths) + 1):
        groups = balanced(lengths, count)
        if all(sum(lengths[i] for i in g) <= limit for g in groups):
            return groups
    raise AssertionError("one row per group always keeps within the budget")


def balanced(lengths: Sequence[int], count: int) -> list[list[int]]:
    """`count` groups of rows with about equal token sums: rows dealt longest first, each to the group with the
    fewest tokens so far (the first such group on ties; Graham's LPT rule, within 4/3 of the best largest sum).
    Groups listed by their longest row, longest first; rows in each group in ascending order; no empty group when
    there are at least `count` rows."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = [[] for _ in range(min(count, len(lengths)))]
    loads = [0] * len(groups)
    for i in order:
        g = loads.index(min(loads))
        groups[g].append(i)
        loads[g] += lengths[i]
    return [sorted(g) for g in groups]


def balanced_parts(lengths: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """The rows dealt into parts of `sizes` rows each with about equal token sums: longest first, each to the part
    with the fewest tokens among those with room left (the first such part on ties; Graham's LPT rule under a
    bound on each part's rows). Rows in each part in ascending order. Data-parallel learners each take a part
    (`TrainBatch.shard`): a learner's step takes as long as its tokens, so equal sums keep any one from waiting on
    another that got all the long responses."""
    if sum(sizes) != len(lengths) or min(sizes, default=0) < 0:
        raise ValueError(f"parts of {list(sizes)} rows cannot hold exactly {len(lengths)} rows")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: equal lengths keep row order
    parts: list[list[int]] = [[] for _ in sizes]
    loads = [0] * len(sizes)
    for i in order:
        g = min((k for k in range(len(sizes)) if len(parts[k]) < sizes[k]), key=lambda k: loads[k])
        parts[g].append(i)
        loads[g] += lengths[i]
    return [sorted(p) for p in parts]


def at_least(groups: list[list[int]], lengths: Sequence[int], min_count: int) -> list[list[int]]:
    """`groups` split until there are `min_count` of them: the group with the most tokens among those of two or
    more rows is halved (rows alternating by length, so both halves hold about half the tokens); when every group
    has one row, empty groups are appended."""
    groups = [list(g) for g in groups]
    while len(groups) < min_count:
        splittable = [g for g in range(len(groups)) if len(groups[g]) > 1]
        if not splittable:
            groups += [[] for _ in range(min_count - len(groups))]
            break
        g = max(splittable, key=lambda k: sum(lengths[i] for i in groups[k]))
        by_length = sorted(groups[g], key=lambda i: -lengths[i])
        groups[g:g + 1] = [sorted(by_length[0::2]), sorted(by_length[1::2])]
    return groups


def micro_batches(lengths: Sequence[int], micro_batch_size: int, max_tokens: int | None = None,
                  min_count: int = 1) -> list[list[int]]:
    """Row-index groups, one per micro-batch, covering every row once: by the token budget `max_tokens` when set
    (`token_budget`), else `micro_batch_size` consecutive rows; then at least `min_count` groups (`at_least`).
    `lengths[i]` is the number of real (unpadded) tokens of row i."""
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    groups = (fixed_count(len(lengths), micro_batch_size) if max_tokens is None
              else token_budget(lengths, max_tokens))
    return at_least(groups, lengths, min_count)
