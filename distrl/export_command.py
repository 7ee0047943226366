"""`distrl export`: a checkpoint's policy as a plain Hugging Face model directory, with the tokenizer, that
transformers and vLLM load without distrl.

A full fine-tuning checkpoint holds the policy in HF format already (policy/model/): it is copied with the tokenizer.
A LoRA checkpoint (`learner.lora`) holds the adapters in PEFT's format (policy/adapter/), which vLLM can serve on top
of the base model as they are (`enable_lora`); `--merge` folds them into the base (W + (alpha/r) B A, peft's
`merge_and_unload`) and writes the merged model. The base is the config's `model.path`, loaded in float32 so that
the merge loses nothing before the output's `dtype`.
"""

from __future__ import annotations

from pathlib import Path

from distrl.config import Config


class ExportError(ValueError):
    """What to export cannot be found, or an adapter checkpoint was asked for without --merge."""


def export(cfg: Config, checkpoint_dir: str, output: str, merge: bool, dtype: str = "float32") -> Path:
    """Write the policy of checkpoint `checkpoint_dir` (RUN_DIR/checkpoints/step_N) as an HF model in `dtype`, with
    `cfg`'s tokenizer, to `output`; returns it."""
    import torch
    from transformers import AutoModelForCausalLM

    from distrl.workers.model_files import DTYPES, load_tokenizer, resolve_model_path
    from distrl.workers.training.lora import ADAPTER_DIR

    policy = Path(checkpoint_dir) / "policy"
    adapter, full = policy / ADAPTER_DIR, policy / "model"
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"--output {out} exists and is not empty")
    if adapter.is_dir():
        if not merge:
            raise ExportError(f"--checkpoint {checkpoint_dir} holds LoRA adapters in PEFT's format ({adapter}), which "
                              f"vLLM serves as they are with enable_lora; add --merge to fold them into the base model")
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg.model), dtype=torch.float32,
                                                    trust_remote_code=cfg.model.trust_remote_code)
        model = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    elif (full / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32,
                                                     trust_remote_code=cfg.model.trust_remote_code)
    else:
        raise ExportError(f"--checkpoint {checkpoint_dir}: neither a policy model ({full}) nor adapters ({adapter}) "
                          f"(a checkpoint directory is RUN_DIR/checkpoints/step_N)")
    model.to(DTYPES[dtype]).save_pretrained(out, safe_serialization=True)
    load_tokenizer(cfg.model).save_pretrained(out)
    return out
