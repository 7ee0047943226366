"""Loading the policy / reference model and tokenizer with transformers, and the one forward pass both score with.

The forward pass returns the log-probs of the response tokens of `Sequences` after temperature scaling (the
same scaling vLLM applied when sampling), computed by `distrl.algo.token_logprobs` so the `[B, T, V]` float32
log-softmax is never materialised.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from distrl.config import ModelConfig
from distrl.types import Sequences

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(cfg: ModelConfig, path: str | None = None) -> str:
    """The model location to load; builds the tiny test model first when the config asks for it and it is absent."""
    path = path or cfg.path
    if cfg.create_tiny_if_missing and not (Path(path) / "config.json").exists():
        from filelock import FileLock

        from distrl.workers.tiny_model import make_tiny_model

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(Path(path)) + ".lock"):  # several actors on one node may ask at once
            if not (Path(path) / "config.json").exists():
                make_tiny_model(path)
    return path


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.tokenizer or resolve_model_path(cfg),
                                        trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(cfg: ModelConfig, dtype: str, path: str | None = None, device: str | torch.device = "cpu"):
    """An HF causal LM in `dtype` on `device`, in train mode off (callers switch it on)."""
    from transformers import AutoModelForCausalLM

    # Typed as a Module: transformers wraps PreTrainedModel.to with functools.wraps, which mypy cannot bind.
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(cfg, path), dtype=DTYPES[dtype], trust_remote_code=cfg.trust_remote_code
    )
    return model.to(device).eval()


def response_logprobs(model, batch: Sequences, temperature: float, with_entropy: bool = False):
    """Log-probs of the response tokens under `model`: `[B, T]` float32 (and entropies `[B, T]` if asked).

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


@torch.no_grad()
def score_in_micro_batches(model, batch: Sequences, temperature: float, micro_batch_size: int) -> torch.Tensor:
    """`response_logprobs` without gradients over micro-batches: `[B, T]` float32 on CPU, 0 on padding."""
    out = [response_logprobs(model, mb, temperature)[0] for mb in batch.chunks(micro_batch_size)]
    return (torch.cat(out) * batch.response_mask).cpu()
