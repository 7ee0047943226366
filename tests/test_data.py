"""Loading prompts (JSON lines, JSON, parquet and CSV files, globs, saved and hub-layout directories, hub names from
the Hugging Face cache offline), prompt columns and templates, chat rendering, filtering, errors, and the stream."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distrl.config import DataConfig
from distrl.data import DataError, PromptStream, check_rows, load_prompts
from distrl.tasks.toy import write_toy_dataset
from distrl.types.prompt import Prompt
from tests.hub_cache import cache_gsm8k_like


@pytest.fixture(autouse=True)
def hf_home(tmp_path, monkeypatch) -> Path:
    """A Hugging Face cache of the test's own, offline: `datasets`' Arrow tables land there, not in HOME."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def load(path, tokenizer, **kwargs):
    return load_prompts(DataConfig(path=str(path), **kwargs), tokenizer)


# -------------------------------------------------------------------------------------------------------- formats
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


def test_toy_dataset_rows_are_deterministic_and_correct(tmp_path):
    a, b = write_toy_dataset(tmp_path / "a.jsonl", n=50), write_toy_dataset(tmp_path / "b.jsonl", n=50)
    assert a.read_text() == b.read_text()
    assert write_toy_dataset(tmp_path / "c.jsonl", n=50, seed=1).read_text() != a.read_text()
    for line in a.read_text().splitlines():
        row = json.loads(line)
        run = [int(x) for x in row["prompt"].rstrip("?").split(":")[-1].split()[-4:] if x.isdigit()]
        assert int(row["answer"]) == run[-1] + 1  # the number after the run


def test_blank_lines_are_skipped_and_answers_optional(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.json", [{"prompt": "a b"}, "", "   ", {"prompt": "c", "answer": 7}])
    prompts, stats = load(path, tokenizer)
    assert [(p.index, p.text, p.answer) for p in prompts] == [(0, "a b", None), (1, "c", "7")]
    assert stats.rows == 2
    prompts, _ = load(path, tokenizer, answer_key=None)
    assert [p.answer for p in prompts] == [None, None]


def test_parquet(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["Count on: 1 2", "Count on: 5 6"], "target": [3, 7]}), path)
    prompts, _ = load(path, tokenizer, prompt_key="question", answer_key="target")
    assert [(p.text, p.answer) for p in prompts] == [("Count on: 1 2", "3"), ("Count on: 5 6", "7")]
    assert prompts[1].sample == {"question": "Count on: 5 6", "target": 7}
    with pytest.raises(DataError, match=rf"{path}: row 0: no prompt field 'prompt'"):
        load(path, tokenizer)


def test_datasets_directory(tmp_path, tokenizer):
    import datasets

    rows = [{"prompt": [{"role": "user", "content": "Count on: 1 2"}], "answer": "3"},
            {"prompt": [{"role": "user", "content": "Count on: 8 9"}], "answer": "10"}]
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "ds")
    prompts, _ = load(tmp_path / "ds", tokenizer)
    assert [p.answer for p in prompts] == ["3", "10"]
    assert prompts[1].text == "<|bos|><|user|>\nCount on: 8 9<|eos|>\n<|assistant|>\n"

    split = datasets.Dataset.from_list(rows)
    datasets.DatasetDict({"train": split, "test": split.select([0])}).save_to_disk(tmp_path / "dd")
    assert len(load(tmp_path / "dd", tokenizer)[0]) == 2  # several splits: 'train'
    assert len(load(tmp_path / "dd", tokenizer, split="test")[0]) == 1
    with pytest.raises(DataError, match=r"data.split 'dev': .* has the splits \['test', 'train'\]"):
        load(tmp_path / "dd", tokenizer, split="dev")
    datasets.DatasetDict({"a": split, "b": split}).save_to_disk(tmp_path / "ab")
    with pytest.raises(DataError, match=r"holds the splits \['a', 'b'\] and none is 'train'"):
        load(tmp_path / "ab", tokenizer)
    datasets.DatasetDict({"test": split}).save_to_disk(tmp_path / "single")
    assert len(load(tmp_path / "single", tokenizer)[0]) == 2  # the only split, whatever its name


@pytest.mark.parametrize("name, message", [("missing.jsonl", "does not exist"), ("d.txt", "unknown format '.txt'")])
def test_unusable_paths(tmp_path, tokenizer, name, message):
    (tmp_path / "d.txt").write_text("prompt\nhi\n")
    with pytest.raises(DataError, match=message):
        load(tmp_path / name, tokenizer)


# ------------------------------------------------------------------------------------------------------ rendering
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


# ------------------------------------------------------------------------------------------------------ filtering
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


# --------------------------------------------------------------------------------------------------- malformed rows
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


def test_invalid_utf8_names_the_line(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match=rf"{path}:2: not valid UTF-8"):
        load(path, tokenizer)


def test_data_module_does_not_import_torch_or_transformers():
    code = "import sys, distrl.data; print(sorted(m for m in ('torch', 'transformers', 'pyarrow') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------------- sources as datasets names them
GSM8K_PROMPT = "{question}\nAnswer with the final number after ####."


def test_a_hub_name_is_read_offline_from_the_hugging_face_cache(hf_home, tokenizer):
    cache_gsm8k_like(hf_home / "hub", train=5)
    prompts, stats = load("openai/gsm8k", tokenizer, subset="main", prompt=GSM8K_PROMPT)
    assert stats.rows == 5 and prompts[2].text == "Count on: 2 3\nAnswer with the final number after ####."
    assert prompts[2].answer.endswith("#### 4") and prompts[2].sample == {"question": "Count on: 2 3",
                                                                         "answer": prompts[2].answer}
    assert len(load("openai/gsm8k", tokenizer, subset="socratic", split="test", prompt="question")[0]) == 2


def test_the_shipped_gsm8k_config_reads_the_hubs_gsm8k_layout_offline(hf_home, tokenizer):
    from distrl import config

    cache_gsm8k_like(hf_home / "hub", train=3)
    data = config.load(Path(__file__).resolve().parents[1] / "configs" / "grpo-gsm8k.yaml").data
    assert check_rows(data) == (3, True)  # chat_template: always
    prompts, _ = load_prompts(data, tokenizer)
    user = {"role": "user", "content": "Count on: 0 1\nAnswer with the final number after ####."}
    assert prompts[0].text == tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=False)
    assert prompts[0].answer == "0 then 1, so the next is 2.\n#### 2"


def test_a_hub_name_needs_a_subset_when_it_has_several(hf_home, tokenizer):
    cache_gsm8k_like(hf_home / "hub")
    with pytest.raises(DataError, match=r"openai/gsm8k: .*main.*socratic") as err:
        load("openai/gsm8k", tokenizer)
    assert err.value.field == "data.subset"
    with pytest.raises(DataError, match=r"data.split 'validation': openai/gsm8k has the splits \['test', 'train'\]"):
        load("openai/gsm8k", tokenizer, subset="main", split="validation")


@pytest.mark.parametrize("switch", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_an_uncached_hub_name_offline_says_where_it_looked_and_how_to_download(hf_home, tokenizer, monkeypatch,
                                                                               switch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv(switch, "1")
    with pytest.raises(DataError) as err:
        load("openai/gsm8k", tokenizer, revision="v2")
    message = str(err.value)
    assert "\n" not in message and err.value.field == "data.path"
    assert message.startswith("openai/gsm8k is no local path") and f"Hugging Face cache {hf_home / 'hub'} " in message
    assert f"{switch} is set" in message and "at revision v2" in message
    assert "`hf download --repo-type dataset openai/gsm8k --revision v2`" in message


def test_a_local_directory_in_the_hub_layout(hf_home, tokenizer):
    snapshot = cache_gsm8k_like(hf_home / "hub", name="someone/copy")
    prompts, _ = load(snapshot, tokenizer, subset="main", split="test", prompt=GSM8K_PROMPT)
    assert [p.text.split("\n")[0] for p in prompts] == ["Count on: 0 1", "Count on: 1 2"]
    with pytest.raises(DataError, match=r"data.revision 'v1' is for hub names"):
        load(snapshot, tokenizer, subset="main", revision="v1")


def test_csv_and_globs_of_files(tmp_path, tokenizer):
    (tmp_path / "a.csv").write_text("question,target\nCount on: 1 2,3\n")
    (tmp_path / "b.csv").write_text("question,target\nCount on: 5 6,7\nCount on: 8 9,10\n")
    prompts, _ = load(tmp_path / "*.csv", tokenizer, prompt="question", answer_key="target")
    assert [(p.text, p.answer) for p in prompts] == [("Count on: 1 2", "3"), ("Count on: 5 6", "7"),
                                                    ("Count on: 8 9", "10")]
    write_jsonl(tmp_path / "p1.jsonl", [{"prompt": "a"}])
    write_jsonl(tmp_path / "p2.jsonl", [{"prompt": "b"}, {"prompt": 5}])
    with pytest.raises(DataError, match=rf"^{re.escape(str(tmp_path / 'p2.jsonl'))}:2: 'prompt' must be a string"):
        load(tmp_path / "p*.jsonl", tokenizer)  # each file's own lines
    with pytest.raises(DataError, match="matches no file"):
        load(tmp_path / "*.parquet", tokenizer)
    with pytest.raises(DataError, match="mixed formats"):
        load(tmp_path / "*", tokenizer)
    with pytest.raises(DataError, match=r"data.subset 'main' names a configuration"):
        load(tmp_path / "a.csv", tokenizer, subset="main")
    with pytest.raises(DataError, match=r"data.split 'test': files are one split"):
        load(tmp_path / "a.csv", tokenizer, split="test")


def test_a_json_array_file(tmp_path, tokenizer):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": "a", "answer": 1}, {"prompt": "b"}], indent=2))
    prompts, _ = load(path, tokenizer)
    assert [(p.text, p.answer) for p in prompts] == [("a", "1"), ("b", None)]
    path.write_text('[{"prompt": "a"},\n {"prompt": "b"')
    with pytest.raises(DataError, match=rf"{path}:2: not valid JSON"):
        load(path, tokenizer)


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


# --------------------------------------------------------------------------------------------------------- stream
def make_prompts(n: int) -> list[Prompt]:
    return [Prompt(index=i, text=str(i), prompt_ids=[i]) for i in range(n)]


def take(stream: PromptStream, n: int) -> list[int]:
    return [p.index for _, p in stream.take(n)]


def test_stream_is_deterministic_per_seed():
    prompts = make_prompts(10)
    assert take(PromptStream(prompts, seed=3), 24) == take(PromptStream(prompts, seed=3), 24)
    assert take(PromptStream(prompts, seed=3), 24) != take(PromptStream(prompts, seed=4), 24)


def test_each_epoch_is_a_fresh_permutation():
    stream = PromptStream(make_prompts(12), seed=0)
    epochs = [take(stream, 12) for _ in range(3)]
    assert all(sorted(e) == list(range(12)) for e in epochs)
    assert epochs[0] != list(range(12)) and len({tuple(e) for e in epochs}) == 3
    assert stream.epoch_of(35) == 2


def test_tickets_number_the_stream_across_epochs():
    stream = PromptStream(make_prompts(5), shuffle=False)
    assert [(t, p.index) for t, p in stream.take(7)] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, 0), (6, 1)]
    assert stream.prompt(12).index == 2 and stream.epoch_of(12) == 2


def test_resume_serves_exactly_the_drawn_but_unconsumed_prompts():
    prompts = make_prompts(7)
    original = PromptStream(prompts, seed=11)
    drawn = original.take(12)  # into the second epoch
    # Trained out of order, as the asynchronous mode does: tickets 0-4, 6 and 9; 5, 7, 8, 10, 11 still in flight.
    original.consume([0, 1, 2, 3, 4, 6, 9])
    state = json.loads(json.dumps(original.state_dict()))  # as a checkpoint stores it
    assert state == {"next": 5, "consumed": [6, 9], "num_prompts": 7}
    resumed = PromptStream(prompts, seed=11)
    resumed.load_state_dict(state)
    again = resumed.take(5)
    assert [t for t, _ in again] == [5, 7, 8, 10, 11]
    assert [p for _, p in again] == [p for t, p in drawn if t in (5, 7, 8, 10, 11)]
    fresh = PromptStream(prompts, seed=11)
    fresh.take(12)
    assert [(t, p.index) for t, p in resumed.take(6)] == [(t, p.index) for t, p in fresh.take(6)]


def test_resume_refuses_a_different_dataset():
    state = PromptStream(make_prompts(7)).state_dict()
    with pytest.raises(ValueError, match="checkpoint saw 7 prompts, the dataset now has 8"):
        PromptStream(make_prompts(8)).load_state_dict(state)


def test_stream_needs_prompts():
    with pytest.raises(ValueError):
        PromptStream([])
