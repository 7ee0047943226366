"""The training side: learner, critic and reference workers, the training core, how models are held (replicated or
sharded), loaded, packed and scored."""
