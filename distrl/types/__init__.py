"""Data contracts that cross actor boundaries.

Each stage has its own type, built once and complete (no field is filled in later):
  prompt.py    `Prompt`          one dataset row, tokenized (data -> rollout actors, reward tasks)
  rollouts.py  `Rollouts`        what an engine produced: ragged per-sample lists (rollout actors -> driver)
               `ScoredRollouts`  rollouts with one reward per sample (driver: buffer, dynamic sampling, advantages)
  batches.py   `Sequences`       the same samples padded into tensors: what the reference and learners score
               `TrainBatch`      sequences with old log-probs, reference log-probs and advantages: what a learner
                                 trains on

Each type has `validate()`; `split(n)` / `concat(parts)` live with the type so that actor groups stay generic. The
ragged stages (`prompt`, `rollouts`) are plain Python; only `batches` imports torch.
"""
