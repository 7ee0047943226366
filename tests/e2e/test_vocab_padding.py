"""A weight push is verified whatever the model's vocabulary: vLLM pads the embedding and the LM head to a multiple
of 64 rows, and the engine's fingerprint (`served_fingerprint`) must leave the padding out on both.

Tiny Llamas (untied LM head) and Qwen2s (tied) of 16, 100 and 50257 (GPT-2's) tokens, none a multiple of 64, each in
a real vLLM CPU engine in this process: learner-side weights, perturbed so that the push changes every tensor, are
loaded bucket by bucket with `load_weights` and checked with `check_weights` against the fingerprint learner 0 sends
(`of_tensors` of the exported weights); a fingerprint whose last vocabulary row is stale is still refused.
"""

import gc

import pytest
import torch

from distrl.config import from_dict
from distrl.workers.rollout.worker import RolloutWorker
from distrl.workers.tiny_model import default_corpus, make_tiny_model
from distrl.workers.training.model import load_causal_lm
from distrl.workers.weights import export
from distrl.workers.weights.fingerprint import WeightMismatch, of_tensors
from distrl.workers.weights.pieces import BucketParts

CORPORA = {
    16: ["0123456789"],  # 10 characters and the 6 special tokens, no merges
    100: default_corpus(),  # its characters (no byte alphabet below 262 tokens) and merges up to 100
    50257: [" ".join(f"{i:x}" for i in range(start, start + 100)) for start in range(0, 400_000, 100)],  # merges
}
"""A corpus that gives the tokenizer exactly each vocabulary size."""

BUCKET_BYTES = 1  # one tensor a bucket: fused layers and a tied head arrive in parts, as in test_qwen2


@pytest.fixture(scope="module", params=[(arch, vocab) for arch in ("llama", "qwen2") for vocab in CORPORA],
                ids=lambda p: f"{p[0]}-{p[1]}")
def engine(request, tmp_path_factory):
    """(config, engine) on a one-layer tiny model of the parametrised architecture and vocabulary, fp32."""
    arch, vocab = request.param
    path = make_tiny_model(tmp_path_factory.mktemp(f"{arch}-{vocab}") / "model", arch=arch, vocab_size=vocab,
                           num_layers=1, corpus=CORPORA[vocab])
    cfg = from_dict({"model": {"path": str(path)}, "data": {"path": "unused"},
                     "rollout": {"dtype": "float32", "sampling": {"max_new_tokens": 4}}})
    worker = RolloutWorker(cfg.rollout, cfg.model, max_prompt_tokens=16, seed=0)
    yield cfg, worker
    del worker
    gc.collect()


def test_a_push_is_verified_whatever_the_vocabulary(engine):
    from tokenizers import Tokenizer

    cfg, worker = engine
    learner = load_causal_lm(cfg.model, "float32")
    vocab = learner.config.vocab_size
    assert vocab in CORPORA and vocab % 64 != 0  # what vLLM pads
    # The trained tokenizer's own vocabulary. (transformers loads a qwen2 model's tokenizer as its Qwen2Tokenizer,
    # which adds "<|endoftext|>" after it, so `len(AutoTokenizer...)` is vocab + 1 there.)
    assert Tokenizer.from_file(f"{cfg.model.path}/tokenizer.json").get_vocab_size() == vocab
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in learner.parameters():  # a tied LM head is one parameter with the embedding
            param.add_(0.01 * torch.randn(param.shape, generator=generator))
    weights = dict(export.exported(learner))
    expected = of_tensors(weights.items(), torch.float32)
    with pytest.raises(WeightMismatch):  # the engine still serves the checkpoint: the push has something to do
        worker.check_weights(0, "rollout-0", expected)

    buckets = [export.bucket(learner, spec, "float32") for spec in export.specs(learner, BUCKET_BYTES, "float32")]
    assert len(buckets) > 1
    assert worker.load_weights(1, [BucketParts.whole(b) for b in buckets]) == 1
    assert worker.check_weights(1, "rollout-0", expected) == 1

    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # the last row before vLLM's padding
        stale = dict(weights)
        stale[name] = weights[name].clone()
        stale[name][vocab - 1] -= 0.01
        with pytest.raises(WeightMismatch, match=rf"rollout-0 serves .* version 1: {name} differs .*; 1 of "):
            worker.check_weights(1, "rollout-0", of_tensors(stale.items(), torch.float32))
