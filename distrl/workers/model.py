"""Loading the policy / reference model and tokenizer with transformers, and the one forward pass both score with.

The forward pass returns the log-probs of the response tokens of `Sequences` after temperature scaling (the
same scaling vLLM applied when sampling), computed by `distrl.algo.token_logprobs` so the `[B, T, V]` float32
log-softmax is never materialised. It runs on the sequences packed into one row, without padding
(`response_logprobs`), so the model's attention must keep them apart: models are loaded with distrl's
`PACKED_ATTENTION`. `padded_response_logprobs` is the padded forward pass it replaced, kept as the reference that
packing is tested against and the baseline of `bench/bench_learner_step.py`.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from distrl.config import ModelConfig
from distrl.hub import local_dir
from distrl.micro_batches import micro_batches
from distrl.types.batches import Sequences
from distrl.workers.packed_attention import PACKED_ATTENTION

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(cfg: ModelConfig, path: str | None = None, weights: bool = True) -> str:
    """The local directory of the model to load (`path`, else `model.path`): a hub name resolved through the
    Hugging Face cache (`distrl.hub.local_dir`; `weights=False` fetches only its config and tokenizer files), or
    the tiny test model, built first when the config asks for it and it is absent."""
    path = path or cfg.path
    if cfg.create_tiny_if_missing:
        from filelock import FileLock

        from distrl.workers.tiny_model import make_tiny_model

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # Always under the lock, even to look: config.json is the first file the build writes, so a look without
        # the lock could see it while another actor is still writing it (and read an empty file).
        with FileLock(str(Path(path)) + ".lock"):
            if not (Path(path) / "config.json").exists():
                make_tiny_model(path)
        return path
    return local_dir(path, weights=weights)


def tokenizer_path(cfg: ModelConfig) -> str:
    """The local directory of the tokenizer: `model.tokenizer`, else the model's, resolved as models are."""
    if cfg.tokenizer:
        return local_dir(cfg.tokenizer, weights=False)
    return resolve_model_path(cfg, weights=False)


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path(cfg), trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(cfg: ModelConfig, dtype: str, path: str | None = None, device: str | torch.device = "cpu"):
    """An HF causal LM in `dtype` on `device`, in train mode off (callers switch it on), whose attention keeps
    packed sequences apart (`PACKED_ATTENTION`)."""
    from transformers import AutoModelForCausalLM

    # Typed as a Module: transformers wraps PreTrainedModel.to with functools.wraps, which mypy cannot bind.
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(cfg, path), dtype=DTYPES[dtype], trust_remote_code=cfg.trust_remote_code,
        attn_implementation=PACKED_ATTENTION,
    )
    return model.to(device).eval()


def padded_response_logprobs(model, batch: Sequences, temperature: float, with_entropy: bool = False):
    """`response_logprobs` on the padded batch `[B, P+T]` (log-probs of padding positions are left as computed).

    Positions are counted from the first real token, so left padding of the prompt does not shift them.
    The logits that predict response token t sit at sequence position P - 1 + t.
    """
    from distrl.algo import entropy_from_logits, token_logprobs

    p, t = batch.prompt_len, batch.response_len
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    kwargs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids,
                  use_cache=False)
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        # Only the last T + 1 positions (P - 1 ... P + T - 1): no [B, P, V] logits for the prompt.
        logits = model(**kwargs, logits_to_keep=t + 1).logits[:, :t]
    else:
        logits = model(**kwargs).logits[:, p - 1 : p - 1 + t]
    ids = batch.input_ids[:, p : p + t]
    logprobs = token_logprobs(logits, ids, temperature=temperature)
    entropy = entropy_from_logits(logits, temperature=temperature) if with_entropy else None
    return logprobs, entropy


def packed_layout(model, batch: Sequences) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The real tokens of `batch` side by side in one row, in the row-major order of the padded batch, for
    `model`, whose attention must keep the sequences of the row apart (`PACKED_ATTENTION`; refused otherwise).

    Returns `ids [1, N]` and `position_ids [1, N]` (restarting at 0 at each sequence's first real token),
    `predicts [K]` (indices into the N tokens of the K positions whose next token is a real response token, in
    the row-major order of the padded batch) and `response [B, T]` bool (those K response tokens in the padded
    layout). With no real token at all the row is one filler token, so that the model still runs.
    """
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if attention != PACKED_ATTENTION:  # any other attention would let the packed sequences see each other
        raise ValueError(f"a packed forward pass puts many sequences in one row, which the model's attention "
                         f"({attention!r}) does not keep apart: load it with attn_implementation="
                         f"{PACKED_ATTENTION!r} (distrl.workers.model.load_causal_lm does)")
    real = batch.attention_mask.bool()
    p = batch.prompt_len
    if p == 0:
        raise ValueError("Sequences: no prompt column; every sequence needs a real prompt token to predict from")
    # Response token t sits at column P + t and is predicted by column P + t - 1, which must be real too.
    response = real[:, p:]
    predicts = torch.zeros_like(real)
    predicts[:, p - 1 : -1] = response & real[:, p - 1 : -1]
    if int(predicts.sum()) != int(response.sum()):
        raise ValueError("Sequences: a response token follows padding (every sequence needs a real prompt token)")
    rank = real.long().cumsum(-1) - 1  # position of each real token in its own sequence
    ids, position_ids = batch.input_ids[real], rank[real]
    if ids.numel() == 0:
        ids, position_ids = ids.new_zeros(1), position_ids.new_zeros(1)
    return ids[None], position_ids[None], predicts[real].nonzero().view(-1), response


def response_logprobs(model, batch: Sequences, temperature: float, with_entropy: bool = False):
    """Log-probs of the response tokens under `model`: `[B, T]` float32, 0 on padding (and entropies `[B, T]` if
    asked), from one packed forward pass.

    The real tokens of the B rows are packed into one row of N tokens (`packed_layout`), with `position_ids`
    restarting at 0 per sequence and no attention mask. The model's attention (`PACKED_ATTENTION`, set when it is
    loaded) reads each restart as a new sequence and attends within it, so every token sees exactly what it sees in
    the padded batch; no padding token reaches a linear layer and attention costs the sum of the squared lengths.
    Logits are made only at the K positions that predict a response token (a hook hands the LM head just those
    hidden states, through the model's own forward, so sharding hooks on the root still run), so no `[N, V]`
    logits exist, and `token_logprobs` never makes a float32 log-softmax of them. Zero rows run the model on one
    token and return `[0, T]` outputs still connected to the graph (see `distrl.micro_batches`).
    """
    from distrl.algo import entropy_from_logits, token_logprobs

    ids, position_ids, predicts, response = packed_layout(model, batch)
    targets = ids.view(-1)[predicts + 1]
    logits = _logits_at(model, ids, position_ids, predicts)
    if predicts.numel() == 0:  # no response token: empty outputs that still lead back through the model
        empty = unpack(logits.float().sum(-1), response)
        return empty, empty if with_entropy else None
    logprobs = unpack(token_logprobs(logits, targets, temperature=temperature), response)
    entropy = unpack(entropy_from_logits(logits, temperature=temperature), response) if with_entropy else None
    return logprobs, entropy


def _logits_at(model, ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Logits `[K, V]` of the packed row `ids [1, N]` at the positions `keep [K]`."""
    kwargs = dict(input_ids=ids, position_ids=position_ids, use_cache=False)
    if not hasattr(model, "get_decoder"):
        return model(**kwargs).logits.flatten(0, 1)[keep]

    def kept_hidden_states(module, args, output):
        hidden = output.last_hidden_state
        output.last_hidden_state = hidden.flatten(0, 1)[keep][None]  # [1, K, H]: the head sees only these
        return output

    handle = model.get_decoder().register_forward_hook(kept_hidden_states)
    try:
        return model(**kwargs).logits[0]
    finally:
        handle.remove()


def unpack(values: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """`[K]` values of the response tokens into the padded layout `[B, T]`, 0 elsewhere (differentiable)."""
    return values.new_zeros(response.shape).masked_scatter(response, values)


@torch.no_grad()
def score_in_micro_batches(model, batch: Sequences, temperature: float, micro_batch_size: int,
                           max_tokens: int | None = None, min_count: int = 1) -> torch.Tensor:
    """`response_logprobs` without gradients over micro-batches (`distrl.micro_batches.micro_batches`: by the
    token budget `max_tokens` when set, else `micro_batch_size` rows each): `[B, T]` float32 on CPU, 0 on padding,
    rows in the batch's order."""
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=batch.response_mask.device)
    lengths = batch.attention_mask.sum(-1).tolist()
    for rows in micro_batches(lengths, micro_batch_size, max_tokens, min_count):
        index = torch.tensor(rows, dtype=torch.long, device=out.device)
        out[index] = response_logprobs(model, batch.select(index), temperature)[0].float()
    return (out * batch.response_mask).cpu()
