"""The config tree as documentation (`distrl.config.fields`): every field found with its path, type, default,
constraints and docstring (so every field has one), variants and list items spelled as a user writes them, and the
paths the documentation may name."""

from __future__ import annotations

from distrl.config import Config, from_dict
from distrl.config.fields import OTHER_SPELLINGS, config_fields, known_path


def by_path(path: str, variant: str | None = None):
    (doc,) = [f for f in config_fields() if f.path == path and (variant is None or f.variant == variant)]
    return doc


def test_every_field_of_every_section_has_a_docstring():
    fields = config_fields()
    assert len(fields) > 200
    assert [f.path for f in fields if not f.doc] == []
    assert [f.path for f in fields if "." not in f.path] == list(Config.model_fields)


def test_a_field_is_described_as_written_in_yaml():
    coef = by_path("loss.kl.coef", "target: loss")
    assert (coef.table, coef.type, coef.default, coef.constraints) == ("loss.kl", "float", "0.0", ">= 0.0")
    assert coef.doc.startswith("Weight beta of the KL term")
    assert by_path("algorithm.lambda").type == "float"  # the YAML key, not Python's `lam`
    assert by_path("env.class").default == "null"
    top_p = by_path("rollout.sampling.top_p")
    assert (top_p.default, top_p.constraints) == ("1.0", "> 0.0, <= 1.0")
    assert by_path("model.path").default == "required"
    assert by_path("run.trackers").default == "[jsonl, tensorboard]"
    assert by_path("data.chat_template").type == '"auto" | "always" | "never"'
    assert by_path("rollout.max_model_len").type == "int | null"
    assert by_path("data.prompt").aliases == ("prompt_key",)


def test_sections_variants_and_list_items():
    assert (by_path("learner.strategy").type, by_path("learner.strategy").default) == ("section", "{type: replicate}")
    assert by_path("loss.correction").type == "section | null"
    assert {f.variant for f in config_fields() if f.path == "loss.correction.low"} == {"mode: tis | icepop",
                                                                                       "mode: seq_mask_tis"}
    # gspo, gmpo and the losses without a clipped surrogate have no dual clip
    assert {f.variant for f in config_fields() if f.path == "loss.policy.dual_clip"} == {"type: ppo",
                                                                                         "type: clip_cov"}
    assert {f.variant for f in config_fields() if f.path == "loss.policy.tau_neg"} == {"type: sapo"}
    assert by_path("loop.max_staleness").variant == "mode: async"
    assert by_path("eval.sets[].name").table == "eval.sets[]"
    assert by_path("rollout.dynamic_sampling.max_rounds").table == "rollout.dynamic_sampling"


def test_known_paths():
    for path in ("loss.kl.coef", "loss.kl", "cluster.rollout.num_gpus", "eval.sets.name", "eval.sets[].name",
                 "data.prompt_key", "algorithm.lambda", "loss.correction.level", *OTHER_SPELLINGS):
        assert known_path(path), path
    for path in ("loss.kl.coeff", "algorithm.lam", "cluster.rollout.gpus", "eval.set.name", "loss.clip_low"):
        assert not known_path(path), path


def test_other_spellings_are_read_by_the_config():
    for old, new in OTHER_SPELLINGS.items():
        assert known_path(new)
        section, key = old.split(".")
        tree = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, section: {key: False}}
        from_dict(tree)  # accepted, not an unknown key
