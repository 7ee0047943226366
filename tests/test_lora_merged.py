"""`learner.lora.serve: merged` and adapters on a mixture of experts' experts (plain classes, no Ray): the merge
W + s B A by hand, a Linear's and a fused expert parameter's (peft's layout), a learner's row block of it equal to
the whole merge's rows; what a merged push sends (whole attention and MLP blocks, equal to peft's own merge, a
model loading them computing the adapted model's logits); the experts' adapters receive the gradients of a float64
difference quotient and start as the base exactly; the refusals, naming their fields; two FSDP learners sending
their own rows of the merged blocks, which assemble to a replicated learner's."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_learner import save
from test_learner_moe import unpadded_batch
from test_lora import randomize_b
from test_sharding import _spawn

from distrl.config import FSDPStrategy, LearnerConfig, LoraConfig, LossConfig, ModelConfig, from_dict
from distrl.merging import values
from distrl.workers.training import lora
from distrl.workers.training.learner import Learner
from distrl.workers.training.model import load_causal_lm
from distrl.workers.weights import export
from distrl.workers.weights.pieces import BucketParts, assemble

MERGED = {"rank": 8, "alpha": 16.0, "serve": "merged"}  # every projection: attention and the experts


def make_learner(model_dir, **lora_cfg) -> Learner:
    cfg = LearnerConfig(lr=1e-2, micro_batch_size=4, max_grad_norm=None, lora=LoraConfig(**{**MERGED, **lora_cfg}))
    return Learner(ModelConfig(path=str(model_dir)), cfg, LossConfig(), temperature=1.0, norm_len=6,
                   mini_batch_size=4, total_optimizer_steps=10, seed=0)


# ------------------------------------------------------------------------------------------------------- the merge
def test_a_linears_merge_by_hand_and_a_block_of_its_rows():
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    a = torch.tensor([[1.0, 0.0]])        # r = 1, in = 2
    b = torch.tensor([[2.0], [-1.0]])     # out = 2
    # B A = [[2, 0], [-1, 0]]; W + 0.5 B A = [[2, 2], [2.5, 4]]
    assert torch.equal(lora.merged_rows(w, a, b, 0.5), torch.tensor([[2.0, 2.0], [2.5, 4.0]]))
    # a learner holding row 1 only merges it with B's row 1: [3, 4] + 0.5 * (-1) * [1, 0]
    assert torch.equal(lora.merged_rows(w[1:], a, b, 0.5, start=1), torch.tensor([[2.5, 4.0]]))


def test_an_expert_stacks_merge_by_hand_in_pefts_layout():
    # E = 2 experts, r = 1, in = 2, out = 1. A [E r, in]: expert 0's row 0, expert 1's row 1. B [out, E r] viewed
    # [out, r, E]: expert 0's column 0 (3), expert 1's column 1 (5).
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    b = torch.tensor([[3.0, 5.0]])
    w = torch.zeros(2, 1, 2)
    # expert 0: 3 [1, 0]; expert 1: 5 [0, 1]; times s = 2
    assert torch.equal(lora.merged_experts(w, a, b, 2.0, 2), torch.tensor([[[6.0, 0.0]], [[0.0, 10.0]]]))
    assert torch.equal(lora.merged_experts(w[1:], a, b, 2.0, 2, start=1), torch.tensor([[[0.0, 10.0]]]))
    # rank 2, E = 2: A's rows 0-1 are expert 0's; B's columns 0 and 2 are expert 0's (j E + e)
    a2 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0]])
    b2 = torch.tensor([[1.0, 10.0, 2.0, 20.0]])
    # expert 0: [1, 2] @ [[1, 0], [0, 1]] = [1, 2]; expert 1: [10, 20] @ [[1, 1], [2, 0]] = [50, 10]
    assert torch.equal(lora.merged_experts(torch.zeros(2, 1, 2), a2, b2, 1.0, 2),
                       torch.tensor([[[1.0, 2.0]], [[50.0, 10.0]]]))


def test_an_expert_blocks_rows_are_the_whole_merges_and_pefts(tiny_qwen3_moe_dir):
    model = lora.wrap(load_causal_lm(ModelConfig(path=str(tiny_qwen3_moe_dir)), "float32"), LoraConfig(**MERGED))
    randomize_b(model)
    from peft.tuners.lora.layer import ParamWrapper

    wrappers = [m for m in model.modules() if isinstance(m, ParamWrapper)]
    assert len(wrappers) == 2 * 2  # gate_up_proj and down_proj in each of 2 layers
    for module in wrappers:
        weight, a, b = module.get_param(), module.lora_A["default"].weight, module.lora_B["default"].weight
        whole = lora.merged_experts(weight, a, b, module.scaling["default"], module.num_experts)
        torch.testing.assert_close(whole, weight + module.get_delta_weight("default"), rtol=1e-6, atol=1e-6)
        for start, end in ((0, 3), (3, 8)):  # uneven row blocks, as FSDP gives 8 experts over 3 learners
            block = lora.merged_experts(weight[start:end], a, b, module.scaling["default"], module.num_experts,
                                        start)
            torch.testing.assert_close(block, whole[start:end], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------- what a merged push sends
def test_a_merged_push_sends_whole_adapted_blocks_equal_to_pefts_merge(tiny_qwen3_moe_dir):
    path = ModelConfig(path=str(tiny_qwen3_moe_dir))
    model = lora.wrap(load_causal_lm(path, "float32"), LoraConfig(**MERGED, target_modules=["q_proj", "gate_proj",
                                                                                             "up_proj"]))
    randomize_b(model)
    sent = dict(export.exported(model))
    # q_proj's block is the attention (vLLM loads q, k, v as one layer), gate_up_proj's the MLP (its experts are one
    # layer, its router another): every tensor of layers' attention and MLP, nothing else (no norm, no embedding).
    layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
             "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
    assert list(sent) == [f"model.layers.{i}.{n}" for i in range(2) for n in layer]
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    base = load_causal_lm(path, "float32").state_dict()
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, merged[name], rtol=1e-6, atol=1e-6, msg=name)
        adapted = name.endswith(("q_proj.weight", "gate_up_proj"))
        assert torch.equal(tensor, base[name]) != adapted, name  # only the adapted tensors differ from the base
    served = load_causal_lm(path, "float32")
    served.load_state_dict({**served.state_dict(), **sent})
    ids = torch.tensor([[5, 17, 33, 8, 90, 2]])
    torch.testing.assert_close(served(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5)
    # (a forward pass re-registers the experts' parameters, which peft parametrizes for it: the order may change)
    spec = {(name, tuple(t.shape)) for name, t in sent.items()}
    assert {s for bucket in export.specs(model, 2**40, "bfloat16") for s in bucket} == spec


def test_a_dense_models_merged_push_carries_its_blocks_biases(tiny_qwen2_dir):
    model = lora.wrap(load_causal_lm(ModelConfig(path=str(tiny_qwen2_dir)), "float32"),
                      LoraConfig(**MERGED, target_modules=["v_proj", "down_proj"]))
    randomize_b(model)
    sent = dict(export.exported(model))
    # v_proj's block: q, k and v with their biases (Qwen2's), o; down_proj's: the MLP's three projections
    assert list(sent)[:7] == [f"model.layers.0.self_attn.{n}" for n in (
        "q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
        "o_proj.weight")]
    assert [n for n in sent if ".layers.0.mlp." in n] == [f"model.layers.0.mlp.{n}_proj.weight"
                                                          for n in ("gate", "up", "down")]
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, merged[name], rtol=1e-6, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------------ the experts' adapters
def test_expert_adapters_start_as_the_base_and_receive_the_gradients_of_a_difference_quotient(tiny_qwen3_moe_dir):
    path = ModelConfig(path=str(tiny_qwen3_moe_dir))
    base = load_causal_lm(path, "float32")
    model = lora.wrap(load_causal_lm(path, "float32"), LoraConfig(**MERGED, target_modules=["gate_proj", "up_proj",
                                                                                             "down_proj"]))
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("mlp.experts" in n and "lora_" in n for n in trained)  # experts' adapters only
    ids = torch.randint(3, 200, (2, 10), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(input_ids=ids).logits, base(input_ids=ids).logits)  # B = 0: exactly the base

    # The experts of layer 0 alone, in float64 (transformers' full model rounds through float32 in its norms and
    # routers: 1e-7 of the loss, which a difference quotient would magnify).
    model.get_base_model().set_experts_implementation("eager")  # transformers' grouped matmul takes no float64
    experts = model.get_base_model().model.layers[0].mlp.experts.double()
    mine = {n.removeprefix("base_model.model.model.layers.0.mlp.experts."): p for n, p in trained.items()
            if ".layers.0." in n}
    assert len(mine) == 4  # A and B of gate_up_proj and of down_proj
    randomize_b(experts)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 128, generator=g, dtype=torch.float64)
    chosen = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(6)])  # top 2 of 8 experts per token
    weights = torch.rand(6, 2, generator=g, dtype=torch.float64)

    def loss():
        return (experts(x, chosen, weights) * torch.linspace(-1, 1, 128, dtype=torch.float64)).sum()

    loss().backward()
    assert all(p.grad.abs().sum() > 0 for p in mine.values())  # every expert adapter's A and B
    direction = {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in mine.items()}
    analytic = sum((p.grad * direction[n]).sum() for n, p in mine.items())
    eps = 1e-6
    with torch.no_grad():
        for n, p in mine.items():
            p.add_(eps * direction[n])
        plus = loss()
        for n, p in mine.items():
            p.sub_(2 * eps * direction[n])
        minus = loss()
    torch.testing.assert_close(analytic, (plus - minus) / (2 * eps), rtol=1e-7, atol=0)


def test_a_learner_trains_the_experts_adapters_and_resumes_them(tiny_qwen3_moe_dir, tmp_path):
    learner = make_learner(tiny_qwen3_moe_dir)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    data = unpadded_batch()
    learner.update(replace(data, old_logprobs=learner.logprobs(data.sequences)))
    after = dict(learner.model.named_parameters())
    moved = {n for n in before if not torch.equal(after[n], before[n])}
    assert any("experts" in n and "lora_B" in n for n in moved) and all("lora_" in n for n in moved)
    path = save(learner, tmp_path / "step_000001", 1)
    adapter = path / "policy" / lora.ADAPTER_DIR
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert {"experts.gate_up_proj", "experts.down_proj"} <= set(saved["target_parameters"])  # PEFT's format
    resumed = make_learner(tiny_qwen3_moe_dir)
    resumed.load_checkpoint(str(path / "policy"), 1)
    assert all(torch.equal(p, after[n]) for n, p in resumed.model.named_parameters())
    seqs = data.sequences
    # peft reads them back as they are, and `distrl export --merge` folds them into the base: the merged model's
    # log-probs are the learner's.
    from peft import PeftModel

    from distrl.export_command import export
    from distrl.workers.training.model import score_in_micro_batches

    base = load_causal_lm(ModelConfig(path=str(tiny_qwen3_moe_dir)), "float32")
    reread = PeftModel.from_pretrained(base, adapter)
    torch.testing.assert_close(score_in_micro_batches(reread, seqs, 1.0, 8), learner.logprobs(seqs), rtol=0,
                               atol=1e-6)
    cfg = from_dict({"model": {"path": str(tiny_qwen3_moe_dir)}, "data": {"path": "d.jsonl"},
                     "learner": {"lora": MERGED}})
    exported = export(cfg, str(path), str(tmp_path / "merged"), merge=True)
    plain = load_causal_lm(ModelConfig(path=str(exported)), "float32")
    torch.testing.assert_close(score_in_micro_batches(plain, seqs, 1.0, 8), learner.logprobs(seqs), rtol=0,
                               atol=1e-5)
    assert torch.equal(resumed.ref_logprobs(seqs), learner.ref_logprobs(seqs))  # the base, adapters disabled
    assert not torch.equal(learner.ref_logprobs(seqs), learner.logprobs(seqs))


# ------------------------------------------------------------------------------------------------------ refusals
def test_the_config_names_the_serving_and_the_experts_fields(tiny_qwen3_moe_dir):
    assert LoraConfig().serve == "adapters"
    with pytest.raises(ValueError, match="serve"):
        LoraConfig(serve="fused")
    with pytest.raises(ValueError, match=r"learner.lora.target_modules \['gate_proj', 'up_proj', 'down_proj'\] on a "
                                         r"mixture of experts adapt its experts' fused parameters .* set "
                                         r"learner.lora.serve 'merged'"):
        make_learner(tiny_qwen3_moe_dir, serve="adapters")
    with pytest.raises(ValueError, match=r"\['gate_proj'\]: a mixture of experts holds its experts' gate and up "
                                         r"projections as one tensor"):
        make_learner(tiny_qwen3_moe_dir, target_modules=["q_proj", "gate_proj"])
    with pytest.raises(ValueError, match=r"learner.lora.dropout 0.1 with adapters on a mixture of experts' experts"):
        make_learner(tiny_qwen3_moe_dir, dropout=0.1)


# -------------------------------------------------------------------------------------------------- FSDP learners
def scenario(rank: int, world: int, port: int, model_dir: Path, out: Path) -> dict:
    learner = Learner(ModelConfig(path=str(model_dir)),
                      LearnerConfig(lr=1e-2, micro_batch_size=4, max_grad_norm=None, strategy=FSDPStrategy(),
                                    lora=LoraConfig(**MERGED)),
                      LossConfig(), temperature=1.0, norm_len=6, mini_batch_size=4, total_optimizer_steps=10, seed=0)
    learner.connect("127.0.0.1", port, rank, world)
    shard = unpadded_batch().shard(world, 1)[rank]
    loss = values(learner.update(replace(shard, old_logprobs=learner.logprobs(shard.sequences))))["loss/policy"]
    (everything,) = learner.weight_specs(2**40, "float32")
    mine = learner.weight_pieces(everything, "float32")
    pieces: list = [None] * world
    torch.distributed.all_gather_object(pieces, mine)
    gathered = learner.weight_bucket(everything, "float32")  # every learner takes part
    experts = "model.layers.0.mlp.experts.gate_up_proj"  # 8 experts: 4 on each learner, merged where they are
    assert mine.rows[experts] == 4 * rank and mine.tensors[experts].shape[0] == 4
    return {"loss": torch.tensor(loss), "assembled": assemble(BucketParts(everything, pieces)),
            "gathered": dict(gathered)}


def test_two_fsdp_learners_send_their_own_rows_of_the_merged_blocks(tiny_qwen3_moe_dir, tmp_path):
    result = _spawn("test_lora_merged:scenario", tiny_qwen3_moe_dir, tmp_path)
    single = make_learner(tiny_qwen3_moe_dir)
    data = unpadded_batch()
    loss = values(single.update(replace(data, old_logprobs=single.logprobs(data.sequences))))["loss/policy"]
    torch.testing.assert_close(result["loss"], torch.tensor(loss), rtol=1e-5, atol=1e-7)
    (everything,) = single.weight_specs(2**40, "float32")
    expected = single.weight_bucket(everything, "float32")
    assert result["assembled"].keys() == expected.keys() == result["gathered"].keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(result["assembled"][name], result["gathered"][name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(result["assembled"][name], tensor, rtol=0, atol=3e-5, msg=name)


def test_from_dict_accepts_merged_serving():
    base = {"model": {"path": "x"}, "data": {"path": "d"}}
    cfg = from_dict({**base, "learner": {"lora": {"serve": "merged"}}})
    assert cfg.learner.lora is not None and cfg.served_adapters is None  # the engines start without LoRA
    assert from_dict({**base, "learner": {"lora": {}}}).served_adapters is not None
