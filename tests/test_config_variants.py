"""The config's discriminated unions: each variant has only its own fields and defaults, the bare tag is shorthand
for a variant, old spellings say what to write instead, and errors name the field, the variant and where both were
set."""

import typing
from types import UnionType

import pytest
import yaml

from distrl import config
from distrl.config import ConfigError
from distrl.config.base import Section
from distrl.config.loading import VARIANTS

MINIMAL = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}}


def load(tmp_path, sections: dict, overrides=()) -> config.Config:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, **sections}, sort_keys=False))
    return config.load(path, list(overrides))


def error(tmp_path, text: str, overrides=()) -> list[str]:
    """The problem lines of loading YAML `text` (after MINIMAL's two sections, which take lines 1-4)."""
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  path: m\ndata:\n  path: d.jsonl\n" + text)
    with pytest.raises(ConfigError) as err:
        config.load(path, list(overrides))
    return [line.strip().replace(f"{tmp_path}/", "") for line in str(err.value).splitlines()[1:]]


def test_gspo_has_its_own_clip_range_and_is_sequence_level(tmp_path):
    policy = load(tmp_path, {"loss": {"policy": "gspo"}}).loss.policy
    assert isinstance(policy, config.GSPOConfig)
    assert (policy.clip_low, policy.clip_high) == (3e-4, 4e-4)  # GSPO paper, arXiv 2507.18071
    assert policy.aggregation == "seq_mean_token_mean" and policy.dual_clip is None and policy.norm_len is None
    assert set(config.GSPOConfig.model_fields) == {"type", "clip_low", "clip_high"}


@pytest.mark.parametrize(("tag", "cls", "defaults"), [
    # each loss's paper's parameters (CISPO: no lower bound, the weight capped at 4; the rest as their papers say)
    ("cispo", config.CISPOConfig, {"clip_low": None, "clip_high": 3.0, "aggregation": "token_mean"}),
    ("sapo", config.SAPOConfig, {"tau_pos": 1.0, "tau_neg": 1.05, "aggregation": "seq_mean_token_mean"}),
    ("gmpo", config.GMPOConfig, {"clip_low": 0.4, "clip_high": 0.4, "aggregation": "seq_mean_token_mean"}),
    ("gpg", config.GPGConfig, {"aggregation": "token_mean"}),
    ("clip_cov", config.ClipCovConfig, {"clip_low": 0.2, "clip_high": 0.2, "clip_cov_ratio": 2e-4,
                                        "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "aggregation": "token_mean"}),
    ("kl_cov", config.KLCovConfig, {"kl_cov_ratio": 2e-3, "ppo_kl_coef": 1.0, "aggregation": "token_mean"}),
])
def test_every_loss_is_a_variant_with_its_paper_s_defaults(tmp_path, tag, cls, defaults):
    policy = load(tmp_path, {"loss": {"policy": tag}}).loss.policy
    assert isinstance(policy, cls) and {key: getattr(policy, key) for key in defaults} == defaults
    assert load(tmp_path, {}, [f"loss.policy={tag}"]).loss.policy == policy  # --set takes the shorthand too


def test_gmpo_is_sequence_level_like_gspo(tmp_path):
    assert set(config.GMPOConfig.model_fields) == {"type", "clip_low", "clip_high"}
    policy = load(tmp_path, {"loss": {"policy": "gmpo"}}).loss.policy
    assert policy.aggregation == "seq_mean_token_mean" and policy.norm_len is None and policy.dual_clip is None


@pytest.mark.parametrize(("text", "expected"), [
    ("loss:\n  policy: {type: sapo, tau_neg: 0}\n", "loss.policy.tau_neg: Input should be greater than 0"),
    ("loss:\n  policy: {type: cispo, clip_high: -1}\n",
     "loss.policy.clip_high: Input should be greater than or equal to 0"),
    ("loss:\n  policy: {type: kl_cov, kl_cov_ratio: 2}\n", "loss.policy.kl_cov_ratio: Input should be less than or "
                                                           "equal to 1"),
    ("loss:\n  policy: {type: clip_cov, clip_cov_lb: 5, clip_cov_ub: 1}\n",
     "loss.policy.clip_cov_lb (5.0) must be below loss.policy.clip_cov_ub (1.0)"),
    ("loss:\n  policy: {type: sapo, clip_high: 0.2}\n", "loss.policy.clip_high: not a field with loss.policy.type "
                                                        "'sapo', whose fields are type, tau_pos, tau_neg, aggregation, "
                                                        "norm_len (type 'ppo', 'gspo', 'cispo', 'gmpo' or 'clip_cov' "
                                                        "has it)"),
    ("loss:\n  policy: {type: gpg, dual_clip: 3}\n", "loss.policy.dual_clip: not a field with loss.policy.type "
                                                     "'gpg'"),
])
def test_each_loss_s_constraints_name_the_field(tmp_path, text, expected):
    lines = error(tmp_path, text)
    assert len(lines) == 1 and lines[0].startswith(expected), lines


def test_ppo_is_the_default_and_a_mapping_without_its_tag_is_ppo(tmp_path):
    default = load(tmp_path, {}).loss.policy
    assert isinstance(default, config.PPOConfig) and (default.clip_low, default.clip_high) == (0.2, 0.2)
    assert default.aggregation == "token_mean"
    untagged = load(tmp_path, {"loss": {"policy": {"clip_high": 0.28, "dual_clip": 3.0}}}).loss.policy
    assert isinstance(untagged, config.PPOConfig) and untagged.clip_high == 0.28 and untagged.dual_clip == 3.0


@pytest.mark.parametrize(("sections", "overrides", "path", "expected"), [
    ({"learner": {"lr_schedule": "cosine"}}, [], "learner.lr_schedule", config.CosineSchedule(min_lr_ratio=0.0)),
    ({}, ["learner.lr_schedule=cosine", "learner.lr_schedule.min_lr_ratio=0.1"], "learner.lr_schedule",
     config.CosineSchedule(min_lr_ratio=0.1)),
    ({}, [], "learner.lr_schedule", config.ConstantSchedule()),
    ({}, ["loss.kl.target=reward"], "loss.kl", config.KLInReward(coef=0.0, estimator="k3")),
    ({"loss": {"kl": {"coef": 0.1}}}, [], "loss.kl", config.KLInLoss(coef=0.1)),
    ({"loss": {"kl": "reward"}}, ["loss.kl.coef=0.1"], "loss.kl", config.KLInReward(coef=0.1)),
    ({"loss": {"correction": "icepop"}}, [], "loss.correction",
     config.RatioCorrection(mode="icepop", level="token", low=0.0, high=2.0)),
    ({"loss": {"correction": {"low": 0.5}}}, [], "loss.correction", config.RatioCorrection(mode="tis", low=0.5)),
    ({}, ["loss.correction=seq_mask_tis", "loss.correction.low=0.5"], "loss.correction",
     config.SeqMaskTISCorrection(low=0.5, high=2.0)),
    ({"loss": {"policy": "gspo"}}, ["loss.policy.clip_high=1e-3"], "loss.policy",
     config.GSPOConfig(clip_low=3e-4, clip_high=1e-3)),
    ({"loss": {"policy": {"type": "ppo", "clip_high": 0.28}}}, ["loss.policy=gspo"], "loss.policy",
     config.GSPOConfig()),
    ({"loop": "async"}, [], "loop", config.AsyncLoop(mode="async", max_staleness=1)),
])
def test_spellings_of_a_variant(tmp_path, sections, overrides, path, expected):
    section = load(tmp_path, sections, overrides)
    for part in path.split("."):
        section = getattr(section, part)
    assert section == expected


def test_python_accepts_the_same_shorthand():
    assert config.LossConfig(policy="gspo", kl="reward").policy == config.GSPOConfig()
    assert isinstance(config.LearnerConfig(lr_schedule="cosine").lr_schedule, config.CosineSchedule)


@pytest.mark.parametrize("sections", [
    {"loss": {"policy": "gspo", "kl": {"target": "reward", "coef": 0.1, "estimator": "k2"},
              "correction": {"mode": "seq_mask_tis", "low": 0.5}}},
    {"loss": {"policy": {"dual_clip": 3.0, "aggregation": "seq_mean_token_sum_norm", "norm_len": 16},
              "correction": {"mode": "icepop", "level": "sequence"}},
     "learner": {"lr_schedule": {"type": "cosine", "min_lr_ratio": 0.1}}, "loop": {"mode": "async"}},
])
def test_every_variant_round_trips_through_yaml(tmp_path, sections):
    cfg = load(tmp_path, sections)
    assert config.from_dict(yaml.safe_load(config.to_yaml(cfg))) == cfg


def test_a_field_of_another_variant_names_the_variant_and_where_each_was_set(tmp_path):
    lines = error(tmp_path, "loss:\n  policy: gspo\n", ["loss.policy.dual_clip=3"])
    assert lines == ["loss.policy.dual_clip: not a field with loss.policy.type 'gspo', whose fields are type, "
                     "clip_low, clip_high (type 'ppo' or 'clip_cov' has it)  (--set loss.policy.dual_clip=3, "
                     "c.yaml:6)"]
    lines = error(tmp_path, "loss:\n  policy:\n    type: gspo\n    aggregation: token_mean\n")
    assert lines == ["loss.policy.aggregation: not a field with loss.policy.type 'gspo', whose fields are type, "
                     "clip_low, clip_high (type 'ppo', 'cispo', 'sapo', 'gpg', 'clip_cov' or 'kl_cov' has it)  "
                     "(c.yaml:8, c.yaml:7)"]
    # gmpo is sequence-level too: its aggregation is the paper's, and writing one is refused by name
    lines = error(tmp_path, "loss:\n  policy:\n    type: gmpo\n    aggregation: token_mean\n")
    assert lines[0].startswith("loss.policy.aggregation: not a field with loss.policy.type 'gmpo', whose fields are "
                               "type, clip_low, clip_high (type 'ppo', ")


def test_seq_mask_tis_has_no_level(tmp_path):
    lines = error(tmp_path, "loss:\n  correction: {mode: seq_mask_tis, level: token}\n")
    assert lines == ["loss.correction.level: not a field with loss.correction.mode 'seq_mask_tis', whose fields "
                     "are mode, low, high (mode 'tis' or 'icepop' has it)  (c.yaml:6)"]


def test_k3_plus_is_not_offered_for_kl_in_the_reward(tmp_path):
    lines = error(tmp_path, "loss:\n  kl: {coef: 0.1, estimator: k3+}\n", ["loss.kl.target=reward"])
    assert lines == ["loss.kl.estimator: Input should be 'k1', 'k2' or 'k3' (with loss.kl.target 'reward')  "
                     "(c.yaml:6, --set loss.kl.target=reward)"]


@pytest.mark.parametrize(("text", "overrides", "expected"), [
    ("loss:\n  policy: grpo\n", [], "loss.policy.type: 'grpo' is not one of ppo, gspo, cispo, sapo, gmpo, gpg, "
                                    "clip_cov, kl_cov  (c.yaml:6)"),
    ("", ["loss.kl.target=penalty"], "loss.kl.target: 'penalty' is not one of loss, reward  "
                                     "(--set loss.kl.target=penalty)"),
    ("learner:\n  lr_schedule: {type: linear}\n", [],
     "learner.lr_schedule.type: 'linear' is not one of constant, cosine  (c.yaml:6)"),
])
def test_an_unknown_tag_lists_the_variants(tmp_path, text, overrides, expected):
    assert error(tmp_path, text, overrides) == [expected]


@pytest.mark.parametrize(("text", "expected"), [
    ("loss:\n  clip_high: 0.28\n",
     "loss.clip_high is now loss.policy.clip_high: write `loss.policy: {type: ppo, clip_high: 0.28}` (gspo has its "
     "own default)  (c.yaml:6)"),
    ("loss:\n  policy: gspo\n  aggregation: seq_mean_token_mean\n",
     "loss.aggregation is now loss.policy.aggregation, a field of the per-token objectives (not of gspo or gmpo, "
     "which are sequence-level): write `loss.policy: {type: ppo, aggregation: seq_mean_token_mean}`, or leave it out "
     "with gspo or gmpo, which always aggregate seq_mean_token_mean  (c.yaml:7, c.yaml:6)"),
    ("loss:\n  norm_len: 512\n",
     "loss.norm_len is now loss.policy.norm_len, a field of the per-token objectives (not of gspo or gmpo, which are "
     "sequence-level): write `loss.policy: {type: ppo, aggregation: seq_mean_token_sum_norm, norm_len: 512}`  "
     "(c.yaml:6)"),
    ("learner:\n  lr_schedule: cosine\n  min_lr_ratio: 0.1\n",
     "learner.min_lr_ratio is now learner.lr_schedule.min_lr_ratio, a field of the cosine schedule only: write "
     "`learner.lr_schedule: {type: cosine, min_lr_ratio: 0.1}`  (c.yaml:7, c.yaml:6)"),
])
def test_an_old_spelling_says_what_to_write_instead(tmp_path, text, expected):
    assert error(tmp_path, text) == [expected]


def _members(tp) -> list:
    """The types a field may hold, through Annotated and nested or optional unions."""
    if typing.get_origin(tp) is typing.Annotated:
        return _members(typing.get_args(tp)[0])
    if typing.get_origin(tp) in (typing.Union, UnionType):
        return [m for a in typing.get_args(tp) for m in _members(a)]
    return [tp]


def _unions(model: type[Section], path: tuple[str, ...] = ()) -> dict[tuple[str, ...], set[type]]:
    """Every field of the tree whose type is a union of several sections, by path."""
    found = {}
    for name, field in model.model_fields.items():
        sections = {a for a in _members(field.annotation) if isinstance(a, type) and issubclass(a, Section)}
        if len(sections) > 1:
            found[(*path, field.alias or name)] = sections
        for section in sections:
            found.update(_unions(section, (*path, field.alias or name)))
    return found


def test_the_variants_registry_lists_every_union_of_the_tree():
    assert {path: set(v.classes.values()) for path, v in VARIANTS.items()} == _unions(config.Config)


def test_a_moved_field_is_named_in_the_section_it_was_written_in():
    base = {"model": {"path": "m"}, "data": {"path": "d"}, "algorithm": {"advantage": "gae"}}
    with pytest.raises(config.ConfigError, match=r"critic\.min_lr_ratio is now critic\.lr_schedule\.min_lr_ratio.*"
                                                  r"`critic\.lr_schedule: \{type: cosine, min_lr_ratio: 0\.1\}`"):
        config.from_dict({**base, "critic": {"min_lr_ratio": 0.1}})
