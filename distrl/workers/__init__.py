"""Plain worker classes, no Ray here, a room per job: rollout/ (the engine side: vLLM engines, sampling, episodes),
training/ (the learner, critic and reference models, their strategies and kernels), weights/ (what crosses between
them: export, fingerprints, NCCL, the HF copy), rewards/ (reward functions). Beside them, what both sides use (the
device, a model's files, the tiny test model) and the hybrid worker that holds both sides in one process."""
