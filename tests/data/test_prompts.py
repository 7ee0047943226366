"""Rows -> prompts (`distrl.data.prompts`): prompt columns and templates, chat rendering with BOS once, what the
reward receives, filtering by length, and each malformed row named by its file and line."""

from __future__ import annotations

import json
import re

import pytest

from distrl.config import DataConfig
from distrl.data.prompts import check_rows
from distrl.data.sources import DataError
from tests.data.helpers import load, write_jsonl


def test_toy_dataset_loads_with_bos_once(toy_dataset, tokenizer):
    prompts, stats = load(toy_dataset, tokenizer)
    rows = [json.loads(line) for line in toy_dataset.read_text().splitlines()]
    assert len(prompts) == len(rows) == 256 and (stats.rows, stats.kept, stats.dropped) == (256, 256, 0)
    first = prompts[0]
    assert (first.index, first.text, first.answer, first.sample) == (0, rows[0]["prompt"], rows[0]["answer"], rows[0])
    assert first.prompt_ids == tokenizer(rows[0]["prompt"])["input_ids"]
    assert all(p.prompt_ids[0] == tokenizer.bos_token_id and tokenizer.bos_token_id not in p.prompt_ids[1:]
               for p in prompts)
    assert stats.longest == max(len(p.prompt_ids) for p in prompts)


def test_chat_messages_are_rendered_without_a_second_bos(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "Digits only."}, {"role": "user", "content": "Count on: 4 5"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": messages, "answer": "6"}])
    (prompt,), _ = load(path, tokenizer)
    assert prompt.text == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.text.endswith("<|assistant|>\n")
    assert prompt.prompt_ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                              return_dict=False)
    assert prompt.prompt_ids.count(tokenizer.bos_token_id) == 1


def test_chat_template_modes(tmp_path, tokenizer):
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "Count on: 1 2"}])
    (auto,), _ = load(plain, tokenizer, chat_template="auto")
    (always,), _ = load(plain, tokenizer, chat_template="always")
    assert auto.text == "Count on: 1 2"
    assert always.text == "<|bos|><|user|>\nCount on: 1 2<|eos|>\n<|assistant|>\n"
    assert always.prompt_ids.count(tokenizer.bos_token_id) == 1
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match=rf"{chat}:1: 'prompt' holds chat messages but data.chat_template is 'never'"):
        load(chat, tokenizer, chat_template="never")


def test_plain_prompt_that_already_starts_with_bos_gets_no_second_one(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "<|bos|>Count on: 1 2"}])
    (prompt,), _ = load(path, tokenizer)
    assert prompt.prompt_ids.count(tokenizer.bos_token_id) == 1


def test_tokenizer_without_chat_template_is_a_clear_error(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(tiny_model_dir)
    bare.chat_template = None
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    with pytest.raises(DataError, match="tokenizer has none"):
        load(path, bare, chat_template="always")


def test_long_prompts_are_dropped_and_counted(tmp_path, tokenizer):
    rows = [{"prompt": "a", "answer": "0"}, {"prompt": "Count on: " + " ".join(map(str, range(100)))},
            {"prompt": "b", "answer": "2"}, {"prompt": "word " * 50}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    prompts, stats = load(path, tokenizer, max_prompt_tokens=8)
    assert [p.index for p in prompts] == [0, 2]  # indices keep the dataset positions
    assert (stats.rows, stats.kept, stats.dropped, stats.longest) == (4, 2, 2, 2)  # "a" is BOS + one token
    with pytest.raises(DataError, match=r"no prompts left: 4 rows read, 4 longer than data.max_prompt_tokens \(1\)"):
        load(path, tokenizer, max_prompt_tokens=1)


def test_empty_file_is_an_error(tmp_path, tokenizer):
    with pytest.raises(DataError, match="no prompts left: 0 rows read"):
        load(write_jsonl(tmp_path / "empty.jsonl", []), tokenizer)


@pytest.mark.parametrize("bad, message", [
    ('{"prompt": "unterminated', "not valid JSON"),
    ('[1, 2]', "expected an object with a 'prompt' field, got list"),
    ('{"question": "hi"}', r"no prompt field 'prompt' \(data.prompt\); the row has \['question'\]"),
    ('{"prompt": 5}', "must be a string or a list of chat messages, got int"),
    ('{"prompt": ""}', "'prompt' is empty"),
    ('{"prompt": []}', "empty list of chat messages"),
    ('{"prompt": [{"role": "user"}]}', "message 0 must be an object with string 'role' and 'content'"),
    ('{"prompt": [{"role": "user", "content": "a"}, "hi"]}', "message 1 must be an object"),
    ('{"prompt": [{"role": "narrator", "content": "a"}]}', "chat template rejected these messages: unknown chat role"),
    ('{"prompt": "hi", "answer": ["a"]}', "answer field 'answer' .* must be a string or a number, got list"),
])
def test_malformed_line_names_file_and_line(tmp_path, tokenizer, bad, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(f'{{"prompt": "ok"}}\n\n{bad}\n{{"prompt": "ok"}}\n')  # the blank line still counts: line 3
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:3: .*{message}"):
        load(path, tokenizer)


def test_check_rows_reads_every_row_without_a_tokenizer(tmp_path):
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "a"}, {"prompt": "b", "answer": 2}])
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "a"}, {"prompt": [{"role": "user", "content": "b"}]}])
    assert check_rows(DataConfig(path=str(plain))) == (2, False)
    assert check_rows(DataConfig(path=str(plain), chat_template="always")) == (2, True)
    assert check_rows(DataConfig(path=str(chat))) == (2, True)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}] * 99 + [{"prompt": "b", "answer": [1]}])
    with pytest.raises(DataError, match=rf"{bad}:100: answer field 'answer'"):
        check_rows(DataConfig(path=str(bad)))
    with pytest.raises(DataError, match="holds no rows"):
        check_rows(DataConfig(path=str(write_jsonl(tmp_path / "empty.jsonl", ["", ""]))))


def test_a_prompt_template_over_columns(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "Count on: 1 2", "n": 3, "answer": "3"}])
    (prompt,), _ = load(path, tokenizer, prompt="Q: {q} ({n:02d} {{x}}) {q!r}")
    assert prompt.text == "Q: Count on: 1 2 (03 {x}) 'Count on: 1 2'"
    assert prompt.sample == {"q": "Count on: 1 2", "n": 3, "answer": "3"}  # the whole row, as before


@pytest.mark.parametrize("row, template, message", [
    ({"q": "a"}, "{q} {p}", r":1: the template data.prompt names the column 'p', which the row lacks; the row has "
                            r"\['q'\]"),
    ({"q": ["a"]}, "{q}", r":1: column 'q' of the template data.prompt must hold a string or a number, got list"),
    ({"q": None}, "{q}", r":1: column 'q' of the template data.prompt must hold a string or a number, got NoneType"),
    ({"q": "a"}, "{q:d}", r":1: the template data.prompt cannot format column 'q' \('a'\) with \{q:d\}"),
])
def test_template_errors_name_the_row_and_the_field(tmp_path, tokenizer, row, template, message):
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(DataError, match=message) as err:
        check_rows(DataConfig(path=str(path), prompt=template))
    assert err.value.field == "data.prompt"


def test_prompt_key_is_the_earlier_name_of_prompt(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "Count on: 1 2"}])
    assert DataConfig(path=str(path), prompt_key="question").prompt == "question"
    with pytest.raises(ValueError, match=r"data\.prompt and data\.prompt_key are the same field"):
        DataConfig(path=str(path), prompt="question", prompt_key="question")
    for bad, message in [("{", "is no template"), ("{}", "must name a column"), ("{{x}}", "names no column")]:
        with pytest.raises(ValueError, match=message):
            DataConfig(path=str(path), prompt=bad)


def test_a_system_prompt_makes_chat_messages(tmp_path, tokenizer):
    system = {"role": "system", "content": "Digits only."}
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "Count on: 8 9"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Count on: 1 2"}, {"prompt": own}])
    plain, chat = load(path, tokenizer, system_prompt="Digits only.")[0]
    user = {"role": "user", "content": "Count on: 1 2"}
    assert plain.text == tokenizer.apply_chat_template([system, user], add_generation_prompt=True, tokenize=False)
    assert chat.text == tokenizer.apply_chat_template(own, add_generation_prompt=True, tokenize=False)
    assert check_rows(DataConfig(path=str(path), system_prompt="s")) == (2, True)
    with pytest.raises(ValueError, match=r"data\.system_prompt makes every prompt chat messages"):
        DataConfig(path=str(path), system_prompt="s", chat_template="never")


def test_check_rows_renders_the_first_templated_prompts(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": [{"role": "narrator", "content": "b"}]}])
    assert check_rows(DataConfig(path=str(path))) == (2, True)  # without a tokenizer, nothing is rendered
    with pytest.raises(DataError, match=rf"{path}:2: the chat template rejected these messages"):
        check_rows(DataConfig(path=str(path)), tokenizer)
    assert check_rows(DataConfig(path=str(path)), tokenizer, rendered=0) == (2, True)


def test_reward_columns_pick_what_the_reward_receives(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1", "id": 7, "meta": {"x": 1}}])
    (prompt,), _ = load(path, tokenizer, reward_columns=["id"])
    assert prompt.sample == {"id": 7} and prompt.row() == {"id": 7, "answer": "1"}
    with pytest.raises(DataError, match=rf"{path}:1: no column 'idx' \(data.reward_columns\)") as err:
        check_rows(DataConfig(path=str(path), reward_columns=["id", "idx"]))
    assert err.value.field == "data.reward_columns"
