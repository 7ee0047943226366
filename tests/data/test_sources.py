"""Reading prompt rows (`distrl.data.sources`): JSON lines, JSON, parquet and CSV files, globs, saved and hub-layout
directories, hub names from the Hugging Face cache offline, and errors at their file and line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distrl.data.prompts import check_rows, load_prompts
from distrl.data.sources import DataError
from distrl.tasks.toy import write_toy_dataset
from tests.data.helpers import load, write_jsonl
from tests.hub_cache import cache_gsm8k_like


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


def test_invalid_utf8_names_the_line(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match=rf"{path}:2: not valid UTF-8"):
        load(path, tokenizer)


def test_a_json_array_file(tmp_path, tokenizer):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": "a", "answer": 1}, {"prompt": "b"}], indent=2))
    prompts, _ = load(path, tokenizer)
    assert [(p.text, p.answer) for p in prompts] == [("a", "1"), ("b", None)]
    path.write_text('[{"prompt": "a"},\n {"prompt": "b"')
    with pytest.raises(DataError, match=rf"{path}:2: not valid JSON"):
        load(path, tokenizer)


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
    data = config.load(Path(__file__).resolve().parents[2] / "configs" / "grpo-gsm8k.yaml").data
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


def test_data_module_does_not_import_torch_or_transformers():
    code = ("import sys, distrl.data.sources, distrl.data.prompts, distrl.data.stream; "
            "print(sorted(m for m in ('torch', 'transformers', 'pyarrow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def numbered_rows(count: int, broken_at: int | None = None) -> list[dict]:
    """A data function (`tests.data.test_sources:numbered_rows`): `count` rows, one without a prompt at
    `broken_at`."""
    return [{"answer": str(i)} if i == broken_at else {"prompt": f"say {i}", "answer": str(i)} for i in range(count)]


def test_rows_made_by_a_function_load_as_a_files_rows_do(tokenizer):
    from distrl.config import DataConfig

    spec = "tests.data.test_sources:numbered_rows"
    prompts, stats = load_prompts(DataConfig(function=spec, kwargs={"count": 3}), tokenizer)
    assert [p.text for p in prompts] == ["say 0", "say 1", "say 2"] and stats.rows == 3
    assert [p.answer for p in prompts] == ["0", "1", "2"]
    with pytest.raises(DataError, match=rf"{spec}: row 1: no prompt field 'prompt'"):
        check_rows(DataConfig(function=spec, kwargs={"count": 3, "broken_at": 1}))
    with pytest.raises(DataError, match=r"numbered_rows\(size=3\) failed: TypeError") as err:
        check_rows(DataConfig(function=spec, kwargs={"size": 3}))
    assert err.value.field == "data.kwargs"
    with pytest.raises(DataError, match="has no attribute 'nope'") as err:
        check_rows(DataConfig(function="tests.data.test_sources:nope"))
    assert err.value.field == "data.function"
