"""`distrl.workers.weights.export`: what the engines are sent, in which buckets, in which dtype."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from distrl.workers.weights import export


def tied_qwen2() -> torch.nn.Module:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def test_a_tied_embedding_is_sent_under_both_names():
    # vLLM's CPU build repacks the LM head apart from the embedding: a head not sent keeps the old weights.
    model = tied_qwen2()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    sent = dict(export.exported(model))
    assert torch.equal(sent["lm_head.weight"], sent["model.embed_tokens.weight"])
    assert len(sent) == len(model.state_dict())
    assert "model.layers.0.self_attn.q_proj.bias" in sent  # Qwen2's QKV bias is sent


def test_buckets_hold_about_the_bytes_asked_and_every_tensor_once():
    model = tied_qwen2()
    item = 2  # bfloat16
    sizes = {name: t.numel() * item for name, t in export.exported(model)}
    layout = export.specs(model, bucket_bytes=2048, dtype="bfloat16")
    assert [n for spec in layout for n, _ in spec] == list(sizes)
    for spec in layout:
        total = sum(sizes[n] for n, _ in spec)
        assert total <= 2048 or len(spec) == 1  # a bigger tensor travels alone
    bucket = export.bucket(model, layout[0], "bfloat16")
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in bucket.values())
    name, shape = layout[0][0]
    assert tuple(bucket[name].shape) == shape
    assert torch.equal(bucket[name], model.state_dict()[name].to(torch.bfloat16))


def test_a_bucket_pickles_its_tensors_out_of_band_and_comes_back_equal():
    """Each tensor travels as one out-of-band buffer (the object store maps it instead of copying it), and comes
    back with its dtype, shape and bits, bfloat16 and 0-dim included; the rebuilt tensors are views of the buffers."""
    import pickle

    model = tied_qwen2()
    spec = export.specs(model, bucket_bytes=1 << 20, dtype="bfloat16")[0]
    sent = export.Bucket(export.bucket(model, spec, "bfloat16"))
    sent["scalar"] = torch.tensor(3.5, dtype=torch.float32)
    buffers: list = []
    data = pickle.dumps(sent, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == len(sent) and len(data) < 4096  # the bytes are not in the pickle itself
    received = pickle.loads(data, buffers=buffers)
    assert isinstance(received, export.Bucket) and received.keys() == sent.keys()
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape
        assert torch.equal(received[name].view(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
    raw = buffers[0].raw()
    first = received[spec[0][0]]
    assert first.data_ptr() == torch.frombuffer(raw, dtype=torch.uint8).data_ptr()  # no copy on the way in
