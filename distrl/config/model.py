"""`model` and `data`: the policy model to train and serve, and the prompts it is trained on."""

from __future__ import annotations

import string
from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from distrl.config.base import Section


class ModelConfig(Section):
    path: str = Field(min_length=1)
    """Local directory or hub name of the policy model (HF format). The learner trains it, vLLM serves it."""
    tokenizer: str | None = None
    """Tokenizer location; null means the model path."""
    trust_remote_code: bool = False
    """Passed to transformers and vLLM when loading the model and tokenizer."""
    create_tiny_if_missing: bool = False
    """Build distrl's tiny random test model at `path` when nothing is there (seeded, so every node that needs it
    builds identical weights). For the quickstart and tests, where no hub is reachable; never set it for real runs."""


class DataConfig(Section):
    path: str | None = Field(default=None, min_length=1)
    """Where the prompts are, as `datasets.load_dataset` takes it: a JSON-lines file (`.jsonl`, `.json`; read line by
    line, so that errors name `file:line`), a `.parquet` or `.csv` file, a glob of such files (`data/*.parquet`), a
    directory in the hub's layout or one saved with `save_to_disk`, or a hub name (`openai/gsm8k`), resolved
    through the Hugging Face cache: downloaded once, or with `HF_HUB_OFFLINE=1` read from the cache alone. Give
    this or `function`."""
    function: str | None = Field(default=None, min_length=1)
    """Or a function that makes the rows, `package.module:function` called with `kwargs`, returning an iterable of
    dicts: a procedural generator (`distrl.standards.reasoning_gym:rows`), an environment's own data set
    (`distrl.standards.verifiers:rows`), or seeds for environments that make their own prompts
    (`distrl.standards:seeds`). See docs/environments.md."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of `function`."""
    subset: str | None = None
    """The data set's configuration (`datasets`' `name`, e.g. `main` of `openai/gsm8k`); null: its only one."""
    split: str | None = None
    """The split to train on; null: the only split, or `train` where there are several."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of a hub-named data set; null: `main`."""
    prompt: str = Field(default="prompt", min_length=1, validation_alias=AliasChoices("prompt", "prompt_key"))
    """The prompt: the column holding it (a string, or a list of chat messages `{role, content}`), or a template
    over columns when it holds `{...}`: `"{question}\nAnswer with the final number after ####."` (Python's
    `str.format` fields, each a column name; `{{` and `}}` are literal braces). Also spelled `prompt_key`, its
    earlier name."""
    system_prompt: str | None = None
    """A system message put before each prompt (rows whose chat messages start with their own keep theirs); the
    prompt is then rendered with the tokenizer's chat template, whatever `chat_template` says for plain strings."""
    answer_key: str | None = "answer"
    """Column holding the reference answer handed to the reward function; null when the task has none."""
    reward_columns: list[str] | None = None
    """Columns of the row the reward function (or environment) receives in its `sample`, besides the answer;
    null: the whole row."""
    chat_template: Literal["auto", "always", "never"] = "auto"
    """`auto`: chat messages are rendered with the tokenizer's template, plain strings are used as they are;
    `always`: plain strings are wrapped as one user message and rendered; `never`: messages are an error."""
    max_prompt_tokens: int = Field(default=256, gt=0)
    """Prompts longer than this (in tokens) are dropped at load time and counted."""
    shuffle: bool = True
    """Shuffle the prompt order each epoch, deterministically from `run.seed` and the epoch number."""

    @model_validator(mode="before")
    @classmethod
    def _one_prompt_spelling(cls, data: Any) -> Any:
        if isinstance(data, dict) and "prompt" in data and "prompt_key" in data:
            raise ValueError("data.prompt and data.prompt_key are the same field (prompt_key is its earlier name): "
                             "write only data.prompt")
        return data

    @field_validator("prompt")
    @classmethod
    def _template_parses(cls, prompt: str) -> str:
        fields = template_fields(prompt)
        if fields is not None and not fields:
            raise ValueError(f"{prompt!r} has braces but names no column: write a column name, or a template with "
                             f"fields such as {{question}} ({{{{ and }}}} are literal braces)")
        return prompt

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if (self.path is None) == (self.function is None):
            raise ValueError("give exactly one of data.path (files, a directory or a hub name) and data.function "
                             "(a function that makes the rows)")
        if self.function is not None:
            hub_only = [k for k in ("subset", "split", "revision") if getattr(self, k) is not None]
            if hub_only:
                raise ValueError(f"data.{hub_only[0]} is for data.path; rows made by data.function take their "
                                 f"settings in data.kwargs")
        elif self.kwargs:
            raise ValueError("data.kwargs are the arguments of data.function; data.path takes none")
        return self

    @property
    def source(self) -> str:
        """The source as the messages name it: the path, or the function."""
        return self.path or f"{self.function}"

    @model_validator(mode="after")
    def _system_prompt_needs_a_template(self) -> DataConfig:
        if self.system_prompt is not None and self.chat_template == "never":
            raise ValueError("data.system_prompt makes every prompt chat messages, which data.chat_template 'never' "
                             "forbids: drop one of them")
        return self


def template_fields(prompt: str) -> list[str] | None:
    """The columns a `data.prompt` template names, in order (a column may repeat); None when `prompt` is a column
    name (no `{` or `}`). Raises ValueError for a malformed template (unbalanced braces, a field with no name)."""
    if "{" not in prompt and "}" not in prompt:
        return None
    try:
        parsed = list(string.Formatter().parse(prompt))
    except ValueError as err:
        raise ValueError(f"{prompt!r} is no template: {err} (write {{{{ and }}}} for literal braces)") from None
    fields = []
    for _, name, _, _ in parsed:
        if name == "":
            raise ValueError(f"{prompt!r}: every {{field}} of the template must name a column ({{}} names none)")
        if name is not None:
            fields.append(name)
    return fields
