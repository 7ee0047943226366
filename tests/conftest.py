"""Shared fixtures: the tiny models (built once per session) and the toy dataset; `image` tests run only when asked."""

from __future__ import annotations

from pathlib import Path

import pytest

END_TO_END = "tests/e2e/"


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`make test` runs two workers), the end-to-end runs go to one worker as one unit, in their
    order, one at a time (one Ray cluster per session; vLLM engines sized for one run at a time), while the other
    workers take the unit tests a module at a time. xdist's own `--dist loadgroup` cannot say this with pytest 9.2:
    it tags a group by rewriting `item._nodeid`, which pytest 9.2's node ids no longer read."""
    from xdist.scheduler import LoadScopeScheduling

    class EndToEndApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return END_TO_END if nodeid.startswith(END_TO_END) else super()._split_scope(nodeid)

    return EndToEndApart(config, log)


def pytest_collection_modifyitems(config, items):
    """Tests marked `image` build a container image (many minutes, podman and debootstrap): they run only when the
    `-m` expression names them (`make image-test`), never as part of `make test`."""
    if "image" in (config.getoption("markexpr") or ""):
        return
    image = [item for item in items if item.get_closest_marker("image")]
    if image:
        config.hook.pytest_deselected(items=image)
        items[:] = [item for item in items if not item.get_closest_marker("image")]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """Directory of distrl's tiny random Llama and its tokenizer, built once for the whole session."""
    from distrl.workers.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """distrl's tiny random Qwen2 (tied embeddings, QKV bias, grouped-query attention: 4 query and 2 key/value
    heads of 32) and its tokenizer, built once for the whole session."""
    from distrl.workers.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory) -> Path:
    """distrl's tiny random Qwen3-MoE (every layer 8 experts of intermediate size 64, top 2) and its tokenizer, built
    once for the whole session."""
    from distrl.workers.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), arch="qwen3_moe")


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory) -> Path:
    """distrl's tiny random Mixtral (every layer 8 experts of intermediate size 64, top 2) and its tokenizer, built
    once for the whole session."""
    from distrl.workers.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_mixtral"), arch="mixtral")


@pytest.fixture
def toy_dataset(tmp_path) -> Path:
    """A 256-row toy-task JSONL file."""
    from distrl.tasks.toy import write_toy_dataset

    return write_toy_dataset(tmp_path / "toy.jsonl")
