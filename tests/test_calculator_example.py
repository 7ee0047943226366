"""The calculator example's pieces (examples/calculator): its problems, its warm-start examples (token for token what
an episode holds, the call parsed by the job's own parser), the environment's reward on one row as the shipped
config builds it, and a few warm-start steps and a held-out evaluation that run."""

import asyncio
import random
from pathlib import Path

import pytest

from distrl import config
from distrl.agents.chat import ChatRenderer
from distrl.agents.env import resolve_env
from distrl.agents.tool_calls import ToolCallParser
from distrl.agents.tools.calculator import evaluate as calculate
from distrl.agents.tools.calculator import format_number
from examples.calculator.evaluate import evaluate, right_call
from examples.calculator.problems import expression_of, make_splits
from examples.calculator.warm_start import TOOLS, build_model, example_ids, warm_start

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cfg():
    return config.load(ROOT / "configs" / "agent-calculator.yaml")


@pytest.fixture(scope="module")
def rows():
    return make_splits(200, 20, seed=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, rows):
    return build_model(tmp_path_factory.mktemp("calculator") / "base", rows[0][:50])


def test_problems_are_disjoint_and_their_answers_are_the_calculators(rows):
    train, held_out = rows
    assert len(train) == 200 and len(held_out) == 20
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for row in train + held_out:
        assert row["answer"] == format_number(calculate(expression_of(row)))


def test_a_warm_start_example_is_the_episode_the_job_would_run(rows, model_dir, cfg):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    row = rows[0][0]
    ids, mask = example_ids(tokenizer, row, use_tool=True, rng=random.Random(0))
    chat = ChatRenderer(tokenizer)
    prompt = chat.prompt_ids([{"role": "user", "content": row["prompt"]}], TOOLS)
    assert ids[:len(prompt)] == prompt and not any(mask[:len(prompt)])
    # Runs of trained tokens: the call, then the answer, each ended by EOS; the tool's answer between them is not.
    trained = [i for i, m in enumerate(mask) if m]
    first_end = ids.index(tokenizer.eos_token_id, len(prompt))
    call_text = tokenizer.decode(ids[len(prompt):first_end])
    _, calls, error = ToolCallParser(cfg.env.tool_parser, tokenizer).parse(call_text)
    assert error is None and [(c.name, c.arguments) for c in calls] == [("calculator",
                                                                          {"expression": expression_of(row)})]
    observation = chat.observation_ids([{"role": "tool", "name": "calculator", "content": row["answer"]}], TOOLS,
                                       tokenizer.eos_token_id)
    assert ids[first_end + 1:first_end + 1 + len(observation)] == observation
    answer = ids[first_end + 1 + len(observation):]
    assert tokenizer.decode(answer, skip_special_tokens=True) == row["answer"] and answer[-1] == tokenizer.eos_token_id
    assert trained == list(range(len(prompt), first_end + 1)) + list(range(len(ids) - len(answer), len(ids)))
    # The tools' system text is one token of the example's tokenizer.
    assert len(prompt) < 30
    guess_ids, guess_mask = example_ids(tokenizer, row, use_tool=False, rng=random.Random(0))
    assert guess_ids[:len(prompt)] == prompt and sum(guess_mask) == len(guess_ids) - len(prompt)


def test_the_configs_environment_rewards_the_tools_answer_and_not_a_guess(rows, cfg):
    from distrl.agents.env import ToolCall, Turn

    row = rows[1][0]
    cls = resolve_env(cfg.env.cls)

    async def episode(first: Turn, second: Turn | None) -> float:
        env = cls(**cfg.env.kwargs)
        start = await env.start(row)
        assert [t["function"]["name"] for t in start.tools] == ["calculator"]
        step = await env.step(first)
        if second is None:
            assert step.done
            return step.reward
        assert not step.done and step.messages[0]["content"] == row["answer"]
        step = await env.step(second)
        assert step.done
        return step.reward

    call = Turn("", "", [ToolCall("calculator", {"expression": expression_of(row)})], None, 0)
    wrong = str(int(row["answer"]) + 1)
    assert asyncio.run(episode(call, Turn(row["answer"], row["answer"], [], None, 1))) == 1.0
    assert asyncio.run(episode(call, Turn(wrong, wrong, [], None, 1))) == 0.0
    assert asyncio.run(episode(Turn(wrong, wrong, [], None, 0), None)) == 0.0


def test_a_few_warm_start_steps_lower_the_loss_and_the_evaluation_runs(rows, model_dir, cfg, tmp_path):
    from transformers import AutoTokenizer

    losses = warm_start(model_dir, tmp_path / "warm", rows[0], steps=12, batch_size=8, log_every=0)
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "warm")
    parser = ToolCallParser("hermes", tokenizer)
    row = rows[1][0]
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'
    assert right_call(parser, text % expression_of(row), row["answer"])
    assert not right_call(parser, text % "1 + 1", row["answer"])
    result = evaluate(cfg, tmp_path / "warm", rows[1][:4])
    assert result.n == 4 and 0.0 <= result.tool_use <= result.called <= 1.0 and 0.0 <= result.reward <= 1.0
