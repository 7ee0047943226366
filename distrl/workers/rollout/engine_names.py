"""The names a vLLM model's loader takes for the tensors the learners send, where they differ from transformers'.

The learners send their model's state dict under transformers' names, which for mixtures of experts are not the
checkpoint's: transformers 5 loads Mixtral's `block_sparse_moe` as `mlp` and fuses each layer's per-expert `w1`/`w3`
and `w2` into stacks (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, its checkpoint conversion mapping). vLLM's
Mixtral keeps the checkpoint's module names and takes the stacks whole under its own fused names (`experts.w13`,
`experts.w2`). Qwen3-MoE and the dense models need no renaming (vLLM takes `experts.gate_up_proj` as it is). Each
engine worker renames what it loads (`to_engine`) and names what it serves back (`to_learner`), so that the learners
and the fingerprint check see one set of names.
"""

from __future__ import annotations

RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "mixtral": ((".mlp.", ".block_sparse_moe."), (".experts.gate_up_proj", ".experts.w13"),
                (".experts.down_proj", ".experts.w2")),
}
"""HF `model_type` -> (transformers' part of a name, the engine's), applied in order."""


def to_engine(name: str, model_type: str) -> str:
    """The name vLLM's loader takes for the learners' tensor `name` of a `model_type` model."""
    for learner, engine in RENAMES.get(model_type, ()):
        name = name.replace(learner, engine)
    return name


def to_learner(name: str, model_type: str) -> str:
    """The learners' name of the tensor a `model_type` engine holds as `name` (`to_engine`'s inverse)."""
    for learner, engine in reversed(RENAMES.get(model_type, ())):
        name = name.replace(engine, learner)
    return name
