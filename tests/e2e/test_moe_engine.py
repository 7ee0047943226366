"""Pushes into engines serving a mixture of experts (vLLM's CPU build, in this process, no Ray): the tiny Qwen3-MoE
and Mixtral take the learners' expert stacks and router from two learners' row blocks (each holding half the
experts, as FSDP2 shards them), every worker proves them expert by expert (at TP 2, its block of every expert's
intermediate dimension; both models at TP 1 and TP 2), the engine then samples the log-probs transformers gives the
pushed weights, and a stale expert is named; at TP 2, a LoRA learner's merged push (the adapted blocks alone) is
proven and served."""

from __future__ import annotations

import pytest
import torch

from distrl.config import LoraConfig, ModelConfig, RolloutConfig
from distrl.types.prompt import Prompt
from distrl.workers.rollout.worker import RolloutWorker
from distrl.workers.training import lora
from distrl.workers.training.model import load_causal_lm
from distrl.workers.weights import export
from distrl.workers.weights.fingerprint import WeightMismatch
from distrl.workers.weights.pieces import BucketParts
from tests.e2e.test_tensor_parallel import fingerprint_parts, two_learners
from tests.test_lora import randomize_b

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PROMPTS = [Prompt(index=i, text="", prompt_ids=p) for i, p in enumerate([[5, 17, 33, 8], [40, 2, 9, 11, 12, 13]])]
EXPERTS = "model.layers.1.mlp.experts"


def engine(model_dir, tp: int) -> RolloutWorker:
    cfg = RolloutConfig(dtype="float32", n_samples_per_prompt=2, tensor_parallel_size=tp,
                        sampling={"max_new_tokens": 8, "temperature": 1.0})
    return RolloutWorker(cfg, ModelConfig(path=str(model_dir)), max_prompt_tokens=16, seed=0)


def perturbed(model_dir, seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model of `model_dir` with every weight moved, and its state (the names and layout the learners send)."""
    model = load_causal_lm(ModelConfig(path=str(model_dir)), "float32")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=g))
    return model, {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}


def push(worker: RolloutWorker, version: int, state: dict[str, torch.Tensor]) -> None:
    spec = [(name, tuple(t.shape)) for name, t in state.items()]
    half = len(spec) // 2
    assert worker.load_weights(version, [BucketParts(spec[:half], two_learners(state)),
                                         BucketParts(spec[half:], two_learners(state))]) == version


def served_vs_transformers(worker: RolloutWorker, model: torch.nn.Module) -> float:
    """Largest |vLLM - transformers| over the log-probs of the tokens the engine samples."""
    rollouts = worker.generate(PROMPTS, [0, 1])
    worst = 0.0
    for prompt, response, sampled in zip(rollouts.prompt_ids, rollouts.response_ids, rollouts.rollout_logprobs,
                                         strict=True):
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logprobs = model(input_ids=ids).logits.float().log_softmax(-1)[0, len(prompt) - 1:-1]
        mine = logprobs.gather(-1, torch.tensor(response)[:, None])[:, 0]
        worst = max(worst, (torch.tensor(sampled) - mine).abs().max().item())
    return worst


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_push_into_a_moe_engine_is_proven_expert_by_expert(arch, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    worker = engine(model_dir, 1)
    try:
        model, state = perturbed(model_dir, seed=1)
        assert state[f"{EXPERTS}.gate_up_proj"].shape == (8, 128, 128)  # [E, 2I, H]
        push(worker, 1, state)
        regions = worker.weight_regions()
        assert regions[f"{EXPERTS}.gate_up_proj"] == [None] and regions[f"{EXPERTS}.down_proj"] == [None]
        assert regions["model.layers.1.mlp.gate.weight"] == [None]  # the router
        assert set(regions) == set(state)  # every tensor pushed is proven
        assert worker.check_weights(1, "rollout-0", *fingerprint_parts(two_learners(state), state, None)) == 1
        assert served_vs_transformers(worker, model) < 1e-4

        # Expert 6's down projection alone is stale: it is named.
        stale = dict(state)
        stale[f"{EXPERTS}.down_proj"] = state[f"{EXPERTS}.down_proj"].clone()
        stale[f"{EXPERTS}.down_proj"][6] += 0.5
        worker.load_weights(2, [BucketParts.whole(stale)])
        with pytest.raises(WeightMismatch, match=rf"{EXPERTS}\.down_proj differs .*; 1 of \d+ tensors differ"):
            worker.check_weights(2, "rollout-0", *fingerprint_parts(two_learners(state), state, None))
    finally:
        worker.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_two_workers_each_prove_their_block_of_every_expert(arch, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    worker = engine(model_dir, 2)
    try:
        model, state = perturbed(model_dir, seed=2)
        push(worker, 1, state)
        held = worker.worker_regions()
        # Each worker: its 32 of every expert's 64 gate rows and 64 up rows, and of its 64 down columns.
        assert [[r for n, r in regions if n == f"{EXPERTS}.gate_up_proj"] for regions in held] == [
            [(1, 0, 32), (1, 64, 32)], [(1, 32, 32), (1, 96, 32)]]
        assert [[r for n, r in regions if n == f"{EXPERTS}.down_proj"] for regions in held] == [
            [(2, 0, 32)], [(2, 32, 32)]]
        regions = worker.weight_regions()
        assert regions["model.layers.1.mlp.gate.weight"] == [None]
        assert worker.check_weights(1, "rollout-0", *fingerprint_parts(two_learners(state), state, regions)) == 1
        assert served_vs_transformers(worker, model) < 1e-4

        # Worker 1's up rows of expert 3 are stale: only its check fails, naming the region.
        stale = dict(state)
        stale[f"{EXPERTS}.gate_up_proj"] = state[f"{EXPERTS}.gate_up_proj"].clone()
        stale[f"{EXPERTS}.gate_up_proj"][3, 96:] += 0.5
        worker.load_weights(2, [BucketParts.whole(stale)])
        with pytest.raises(WeightMismatch, match=rf"^rollout-0 \(worker 1 of 2\) .*{EXPERTS}\.gate_up_proj"
                                                 rf"\[1:96:32\] differs .*; 1 of \d+ tensors differ"):
            worker.check_weights(2, "rollout-0", *fingerprint_parts(two_learners(state), state, regions))

        # Adapters on the attention and the experts, served merged (`learner.lora.serve: merged`): a push is the
        # adapted blocks alone (the rest is what the engine holds), each worker proves its regions of them, and the
        # engine serves the adapted model.
        adapted = lora.wrap(model, LoraConfig(serve="merged"))
        randomize_b(adapted)
        sent = dict(export.exported(adapted))
        assert f"{EXPERTS}.gate_up_proj" in sent and "model.embed_tokens.weight" not in sent
        worker.load_weights(3, [BucketParts([(n, tuple(t.shape)) for n, t in sent.items()], two_learners(sent))])
        assert worker.check_weights(3, "rollout-0", *fingerprint_parts(two_learners(sent), sent, regions)) == 3
        assert served_vs_transformers(worker, adapted) < 1e-4
    finally:
        worker.close()
