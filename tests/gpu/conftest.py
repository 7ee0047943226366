"""The GPU smoke suite: every test under tests/gpu is marked `gpu` and skipped where CUDA does not work, so the CPU
suite collects and skips it cleanly; `make gpu-smoke` runs only these on one GPU with torch and transformers (no
vLLM, no Ray). Its models are distrl's tiny ones (tests/conftest.py: `tiny_model_dir`, `tiny_qwen2_dir`) in
bfloat16 on `cuda`, except the learner-step benchmark's random Qwen2.5-shaped models (bench/bench_gpu_step.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    """Mark the tests of this directory `gpu`, and skip them without CUDA."""
    skip = pytest.mark.skip(reason="GPU smoke suite: CUDA is not available (torch "
                                   f"{torch.__version__}); run it on a GPU machine with `make gpu-smoke`")
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
