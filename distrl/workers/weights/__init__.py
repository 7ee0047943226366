"""The weights that cross from the learners to the engines and checkpoints: export in buckets, fingerprints, NCCL,
the HF copy."""
