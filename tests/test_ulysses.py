"""Ulysses sequence parallelism (`learner.sequence_parallel_size`, `distrl.workers.training.ulysses`): two processes in
a real gloo group on the CPU each hold half of a packed micro-batch's tokens, and compute exactly what one process
computes on all of them: the token log-probs and entropies, the loss, and (summed over the two) every gradient, in
float64, for a dense and an MoE model; two learners sharing every micro-batch (a 1 x 2 grid) train as one learner
does, counting each token once; critics and reference actors split alike."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_learner import batch, make_learner, update
from test_learner_fsdp import UPDATES, assert_same_training, full_weights
from test_sharding import _spawn

from distrl.config import FSDPStrategy, ModelConfig, ReplicateStrategy
from distrl.merging import values
from distrl.types.batches import Sequences
from distrl.workers.training import dist
from distrl.workers.training.model import load_causal_lm, response_logprobs
from distrl.workers.training.packing import host_layout

TEMPERATURE = 0.7


def ragged() -> Sequences:
    """3 rows of 7, 10 and 4 real tokens (21: the packed row does not halve, and the 10-token sequence straddles
    the cut at token 11), left-padded prompts of 4 columns and responses of 6."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 200, (3, 10), generator=g)
    attention = torch.ones(3, 10, dtype=torch.long)
    attention[0, :1] = 0
    attention[0, 8:] = 0  # 3 prompt + 4 response tokens
    attention[2, :2] = 0
    attention[2, 6:] = 0  # 2 prompt + 2 response tokens
    mask = attention[:, 4:].float()
    return Sequences(input_ids=ids, attention_mask=attention, response_mask=mask,
                     rollout_logprobs=torch.zeros(3, 6), policy_version=torch.zeros(3, dtype=torch.long),
                     response_versions=torch.zeros(3, 6, dtype=torch.long))


CASES = {"packed": lambda: batch().sequences, "ragged": ragged}
"""test_learner's batch (68 real tokens: left-padded prompts, shorter responses) and `ragged` (21 tokens)."""


def loss_of(logprobs: torch.Tensor, entropy: torch.Tensor, seqs: Sequences) -> torch.Tensor:
    """A loss that weighs every token differently (so a token counted twice, or in the wrong place, shows)."""
    weights = torch.arange(1, seqs.response_mask.numel() + 1, dtype=logprobs.dtype).view_as(logprobs) / 10
    return ((logprobs * weights + 0.3 * entropy) * seqs.response_mask).sum()


def forward_backward(model: torch.nn.Module, seqs: Sequences, split=None) -> dict[str, torch.Tensor]:
    """Log-probs, entropies, the loss and every parameter's gradient of one micro-batch (this process's slice of it
    with `split`)."""
    layout = host_layout(seqs)
    logprobs, entropy = response_logprobs(model, seqs, TEMPERATURE, with_entropy=True,
                                          layout=layout.split(split) if split else layout)
    loss = loss_of(logprobs, entropy, seqs)
    model.zero_grad(set_to_none=False)
    loss.backward()
    return {"logprobs": logprobs.detach(), "entropy": entropy.detach(), "loss": loss.detach(),
            **{f"grad/{name}": p.grad.clone() for name, p in model.named_parameters()}}


VARIANTS = ("chunked", "plain_head", "checkpointed")
"""The chunked LM head (`linear_logprobs`), the plain one, and the chunked one with gradient checkpointing (each
layer's forward, the all-to-alls with it, run again in the backward)."""


def float64_model(model_dir: Path, variant: str) -> torch.nn.Module:
    model = load_causal_lm(ModelConfig(path=str(model_dir)), "float32").double().train()
    if getattr(model.config, "num_experts", None):  # transformers' grouped-matmul experts take no float64
        model.set_experts_implementation("eager")
    if variant == "plain_head":  # a model that transforms its logits takes the plain LM head
        model.config.logit_scale = 2.0  # (`model.logit_transforms`); tiny models ignore the field: same numbers
    if variant == "checkpointed":
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


def scenario_split(rank: int, world: int, port: int, model_dir: Path, out: Path) -> dict:
    """Each case on both ranks, each rank holding half of the packed row: what rank 0 computed, and the gradients
    summed over the two (what FSDP's reduce-scatter sums)."""
    dist.init_process_group("127.0.0.1", port, rank, world, "cpu", sequence_parallel=2)
    split = dist.sequence_split()
    assert split is not None and split.rank == rank and dist.data_parallel_size() == 1
    result = {}
    for variant in VARIANTS:
        model = float64_model(model_dir, variant)
        for case, make in CASES.items():
            got = forward_backward(model, make(), split)
            for key, value in got.items():
                if key.startswith("grad/"):
                    result[f"{case}/{variant}/own/{key}"] = value.clone()
                    torch.distributed.all_reduce(value)
                result[f"{case}/{variant}/{key}"] = value
    return result


def make_tiny_moe(directory: Path) -> Path:
    """A random tiny Qwen3-MoE (hidden 64, 2 layers, 4 experts of width 32, top-2 routing; 4 query and 2 key/value
    heads), its weights only (the forward pass needs no tokenizer)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, mlp_only_layers=[], max_position_embeddings=512)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def model_dirs(tiny_qwen2_dir, tmp_path_factory) -> dict[str, Path]:
    return {"dense": tiny_qwen2_dir, "moe": make_tiny_moe(tmp_path_factory.mktemp("tiny_moe"))}


@pytest.fixture(scope="module")
def split_runs(model_dirs, tmp_path_factory) -> dict[str, dict]:
    return {name: _spawn("test_ulysses:scenario_split", directory, tmp_path_factory.mktemp(f"ulysses_{name}"))
            for name, directory in model_dirs.items()}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_two_ranks_sharing_a_micro_batch_compute_the_unsplit_log_probs_loss_and_gradients(
        split_runs, model_dirs, model, case, variant):
    """Tiny Qwen2 and Qwen3-MoE (4 query and 2 key/value heads: each rank attends with 2 and 1 of them; the experts
    route each token of a rank's slice as they route it in the whole row), float64."""
    split_run = split_runs[model]
    whole = forward_backward(float64_model(model_dirs[model], "plain_head" if variant == "plain_head" else "chunked"),
                             CASES[case]())  # checkpointed: against the pass without recomputation
    prefix = f"{case}/{variant}/"
    mismatched = []
    for key, expected in whole.items():
        torch.testing.assert_close(split_run[prefix + key], expected, rtol=1e-10, atol=1e-12, msg=key)
        if key.startswith("grad/") and expected.abs().max() > 1e-6:
            own = split_run[prefix + "own/" + key]
            mismatched.append(not torch.allclose(own, expected, rtol=1e-6, atol=1e-9))
    # Negative control: one rank's own gradient is only its slice's part; only the sum over the group is whole.
    assert all(mismatched) and len(mismatched) > 10


def scenario_learners(rank: int, world: int, port: int, model_dir: Path, out: Path, strategy: str) -> dict:
    """Two learners with sequence_parallel_size 2 (one data-parallel group): both hold the whole batch, as the loop
    gives it to them, and split every micro-batch (a token budget of 40: the batch's 68 tokens in 2)."""
    learner = make_learner(model_dir, strategy=FSDPStrategy() if strategy == "fsdp" else ReplicateStrategy(),
                           lr=1e-3, sequence_parallel_size=2, max_tokens_per_micro_batch=40)
    learner.connect("127.0.0.1", port, rank, world)
    assert learner.trainer.local_mini_batch_size == 8  # one data-parallel group: every row of each mini-batch
    (shard,) = batch().shard(1, 1)
    losses, tokens, groups = [], [], []
    for _ in range(UPDATES):
        scored = replace(shard, old_logprobs=learner.logprobs(shard.sequences))
        figs = values(learner.update(scored))
        losses.append(figs["loss/policy"])
        tokens.append(figs["learner/tokens"])
        groups.append(len(learner.trainer.micro_rows))
    return {"losses": torch.tensor(losses), "tokens": torch.tensor(tokens), "micro_batches": torch.tensor(groups),
            **full_weights(learner)}


def scenario_learners_replicate(rank: int, world: int, port: int, model_dir: Path, out: Path) -> dict:
    return scenario_learners(rank, world, port, model_dir, out, "replicate")


def scenario_learners_fsdp(rank: int, world: int, port: int, model_dir: Path, out: Path) -> dict:
    return scenario_learners(rank, world, port, model_dir, out, "fsdp")


@pytest.mark.parametrize("strategy", ["replicate", "fsdp"])
def test_two_learners_sharing_every_micro_batch_train_as_one_learner(tiny_model_dir, tmp_path, strategy):
    """The losses (summed over the data-parallel group, not over the two learners that computed the same one),
    the token count and the weights after two updates are one learner's, in the same 2 micro-batches (a set budget
    counts a micro-batch's tokens, however many learners share them)."""
    result = _spawn(f"test_ulysses:scenario_learners_{strategy}", tiny_model_dir, tmp_path)
    single = make_learner(tiny_model_dir, lr=1e-3, max_tokens_per_micro_batch=40)
    data = batch()
    figs = [update(single, replace(data, old_logprobs=single.logprobs(data.sequences))) for _ in range(UPDATES)]
    assert len(single.trainer.micro_rows) == 2
    assert result.pop("micro_batches").tolist() == [2] * UPDATES
    assert result.pop("tokens").tolist() == [figs[0]["learner/tokens"]] * UPDATES == [40.0] * UPDATES
    assert_same_training(result, [f["loss/policy"] for f in figs], full_weights(single))


def scenario_critics(rank: int, world: int, port: int, model_dir: Path, out: Path) -> dict:
    """Two replicated critics with sequence_parallel_size 2 on the whole of test_critic's batch."""
    from test_critic import batch as critic_batch
    from test_critic import make_critic, with_values

    critic = make_critic(model_dir, sequence_parallel_size=2, max_tokens_per_micro_batch=40)
    critic.connect("127.0.0.1", port, rank, world)
    (shard,) = critic_batch().shard(1, 1)
    losses, tokens = [], []
    for _ in range(UPDATES):
        figs = values(critic.update(with_values(critic, shard)))
        losses.append(figs["critic/value_loss"])
        tokens.append(figs["critic/tokens"])
    return {"losses": torch.tensor(losses), "tokens": torch.tensor(tokens),
            "values": critic.values(shard.sequences)}


def test_two_critics_sharing_every_micro_batch_train_as_one_critic(tiny_model_dir, tmp_path):
    """The value model's forward pass splits alike (`critic.sequence_parallel_size`): the same values, value
    losses (summed once per data-parallel group) and token counts as one critic's, update after update."""
    from test_critic import batch as critic_batch
    from test_critic import make_critic, with_values

    result = _spawn("test_ulysses:scenario_critics", tiny_model_dir, tmp_path)
    single = make_critic(tiny_model_dir, max_tokens_per_micro_batch=40)
    data = critic_batch()
    figs = [values(single.update(with_values(single, data))) for _ in range(UPDATES)]
    torch.testing.assert_close(result["losses"], torch.tensor([f["critic/value_loss"] for f in figs]),
                               rtol=1e-5, atol=1e-7)
    assert result["tokens"].tolist() == [figs[0]["critic/tokens"]] * UPDATES == [40.0] * UPDATES
    torch.testing.assert_close(result["values"], single.values(data.sequences), rtol=0, atol=3e-5)


def reference_worker(model_dir: Path, k: int = 1):
    """A reference in float64 whose micro-batches hold at most 40 tokens (the packed batch's 68 in 2)."""
    from distrl.config import ReferenceConfig
    from distrl.workers.training.reference import ReferenceWorker

    reference = ReferenceWorker(ReferenceConfig(sequence_parallel_size=k, max_tokens_per_micro_batch=40),
                                ModelConfig(path=str(model_dir)), TEMPERATURE)
    reference.model.double()
    return reference


def scenario_references(rank: int, world: int, port: int, model_dir: Path, out: Path) -> dict:
    """Two reference actors with sequence_parallel_size 2 (one group) scoring the same rows, as the loop gives them."""
    reference = reference_worker(model_dir, k=2)
    reference.connect("127.0.0.1", port, rank, world)
    return {name: reference.logprobs(make())
            for name, make in CASES.items()}


def test_two_reference_actors_sharing_every_micro_batch_score_as_one(tiny_model_dir, tmp_path):
    """`reference.sequence_parallel_size`: the KL term's log-probs of two reference actors that split every
    micro-batch are one reference's, in float64, for the packed batch and the ragged one (a sequence across the
    cut); each actor answers the whole part (the loop keeps one answer per group)."""
    result = _spawn("test_ulysses:scenario_references", tiny_model_dir, tmp_path)
    single = reference_worker(tiny_model_dir)
    for name, make in CASES.items():
        expected = single.logprobs(make())
        assert result[name].shape == expected.shape and expected.abs().sum() > 0
        torch.testing.assert_close(result[name], expected, rtol=1e-10, atol=1e-12, msg=name)
