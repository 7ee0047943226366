"""verifiers environments through distrl's episode runner, scripted turns on the tiny model's tokenizer: the
environment's own data set, system prompt, tools, tool calls and rubric (its reward and its components as the
episode's figures); the trajectory is the template's deltas of the conversation verifiers holds."""

from __future__ import annotations

import pytest

from distrl.agents.chat import ChatRenderer
from distrl.agents.host import EnvError
from distrl.config import ModelConfig
from distrl.standards import verifiers as adapter
from distrl.workers.model_files import load_tokenizer
from tests.standards.scripted import call, play

pytest.importorskip("verifiers")

ARITH, TOOLS, GUESS = "tests.standards.vf_arith", "tests.standards.vf_tools", "tests.standards.vf_guess"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(ModelConfig(path=str(tiny_model_dir)))


def test_rows_are_the_environments_own_data_set_with_its_system_prompt():
    rows = adapter.rows(ARITH, {"count": 3, "offset": 10})
    assert [r["answer"] for r in rows] == ["21", "23", "25"]
    assert rows[0]["prompt"] == [{"role": "system", "content": "Answer between <answer> and </answer>."},
                                 {"role": "user", "content": "What is 10 + 11?"}]
    assert (rows[0]["task"], rows[0]["example_id"]) == ("default", 0)
    assert [r["answer"] for r in adapter.rows(ARITH, {"count": 3, "offset": 10}, split="eval")] == ["21", "23"]
    assert len(adapter.rows(ARITH, count=5)) == 5
    with pytest.raises(ValueError, match="split must be"):
        adapter.rows(ARITH, split="test")


def test_a_single_turn_episode_is_scored_by_the_rubric_with_its_components(tokenizer):
    rows = adapter.rows(ARITH, {"count": 2})
    right, wrong = play(tokenizer, "distrl.standards.verifiers:VerifiersEnv", {"env_id": ARITH}, rows,
                        ["<answer>\n1\n</answer>"])
    assert (right.episode.turns, right.episode.cut, right.episode.drift) == (1, None, 0)
    # correct_answer 1 (weight 1) + format 1 (weight 0.2); the metric `length` has weight 0.
    assert right.episode.reward == pytest.approx(1.2)
    assert right.episode.metrics["correct_answer"] == 1.0 and right.episode.metrics["error"] == 0.0
    assert right.episode.metrics["length"] == len("<answer>\n1\n</answer>")
    assert wrong.episode.reward == pytest.approx(0.2) and wrong.episode.metrics["correct_answer"] == 0.0
    # The prompt is the data set's messages (system prompt included) rendered by the chat template.
    assert right.trajectory.prompt_ids == ChatRenderer(tokenizer).prompt_ids(rows[0]["prompt"], [])


def test_a_tool_episode_runs_the_tool_and_continues_token_exactly(tokenizer):
    rows = adapter.rows(TOOLS, {"count": 2})
    results = play(tokenizer, "distrl.standards.verifiers:VerifiersEnv", {"env_id": TOOLS}, rows,
                   [call("add", a=1, b=3), "The answer is 4."])
    chat = ChatRenderer(tokenizer)
    tools = adapter.load(TOOLS).oai_tools
    for row, result in zip(rows, results, strict=True):
        e = result.episode
        assert (e.turns, e.tool_calls, e.cut, e.drift, e.template_drift) == (2, 1, None, 0, False)
        assert e.metrics["total_tool_calls"] == 1.0 and e.metrics["add_calls"] == 1.0
        assert e.metrics["num_turns"] == 2.0
        # The tool's result (1 + 3) is the observation between the two turns, as the template renders it.
        t = result.trajectory
        first = [*tokenizer.encode(call("add", a=1, b=3), add_special_tokens=False), tokenizer.eos_token_id]
        observation = chat.observation_ids([{"role": "tool", "content": "4"}], tools, tokenizer.eos_token_id)
        assert t.prompt_ids == chat.prompt_ids(row["prompt"], tools)
        assert t.response_ids[:len(first) + len(observation)] == first + observation
        assert t.mask == [1] * len(first) + [0] * len(observation) + [1] * (len(t.mask) - len(first)
                                                                             - len(observation))
    # "4" is the answer of row 1 (1 + 3), not of row 0 (0 + 3).
    assert [r.episode.reward for r in results] == [0.0, 1.0]


def test_an_empty_reply_is_the_models_error_scored_as_verifiers_scores_it(tokenizer):
    [result] = play(tokenizer, "distrl.standards.verifiers:VerifiersEnv", {"env_id": ARITH},
                    adapter.rows(ARITH, count=1), [""])
    assert result.episode.metrics["error"] == 1.0 and result.episode.cut is None
    assert result.episode.reward == 0.0


def test_a_failing_environment_follows_on_error(tokenizer):
    rows = adapter.rows(TOOLS, {"count": 1})
    kwargs = {"env_id": TOOLS, "env_args": {"count": 1}}
    broken = [{**rows[0], "info": "not json"}]  # verifiers decodes a string info as JSON, and fails
    with pytest.raises(EnvError, match=r"VerifiersEnv.start failed in episode ep.0: JSONDecodeError"):
        play(tokenizer, "distrl.standards.verifiers:VerifiersEnv", kwargs, broken, ["4"])
    [zero] = play(tokenizer, "distrl.standards.verifiers:VerifiersEnv", kwargs, broken, ["4"], on_error="zero")
    assert (zero.episode.cut, zero.episode.reward) == ("env_error", 0.0)


def test_a_completion_reply_carries_the_turns_tool_calls_as_openai_writes_them():
    from distrl.agents.env import ToolCall, Turn

    turn = Turn("<tool_call>...</tool_call>", "", [ToolCall("add", {"a": 1, "b": 2})], None, 3)
    reply = adapter.completion(turn, "distrl")
    [choice] = reply["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"] == [{"id": "call_3_0", "type": "function",
                                                "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]
    plain = adapter.completion(Turn("hi", "hi", [], None, 0, "length"), "distrl")["choices"][0]
    assert (plain["finish_reason"], plain["message"]) == ("length", {"role": "assistant", "content": "hi"})


def test_a_multi_turn_environment_answers_with_user_messages_of_its_own(tokenizer):
    rows = adapter.rows(GUESS)  # the numbers 2, 4 and 5
    results = play(tokenizer, "distrl.standards.verifiers:VerifiersEnv", {"env_id": GUESS}, rows, ["1", "2", "3", "4"],
                   tool_parser=None)
    chat = ChatRenderer(tokenizer)
    eos = tokenizer.eos_token_id
    # Guesses 1, 2, 3, 4 in turn until right (the environment's own stop condition), at most 4 turns; every guess
    # is below the number, so every hint is "Higher.".
    first = [*tokenizer.encode("1", add_special_tokens=False), eos]
    hint = chat.observation_ids([{"role": "user", "content": "Higher."}], [], eos)
    for result, turns in zip(results, [2, 4, 4], strict=True):
        e, t = result.episode, result.trajectory
        assert (e.turns, e.cut, e.drift, e.tool_calls) == (turns, None, 0, 0)
        assert e.metrics["guesses"] == turns and e.metrics["num_turns"] == turns and e.metrics["error"] == 0.0
        # The hint is a user message the template renders after the turn: given, not trained on.
        assert t.response_ids[:len(first) + len(hint)] == first + hint
        assert t.mask[:len(first) + len(hint)] == [1] * len(first) + [0] * len(hint)
        assert t.mask.count(0) == (turns - 1) * len(hint)
    # The rubric's reward: right for 2 and 4; 5 is never guessed in 4 turns.
    assert [r.episode.reward for r in results] == [1.0, 1.0, 0.0]


def test_the_preflight_refuses_a_tool_environment_without_a_tool_parser(tiny_model_dir, tmp_path):
    from distrl import preflight
    from distrl.config import from_dict

    def config(env_id: str, tool_parser: str | None, mixed: bool = False):
        env = {"class": "distrl.standards.verifiers:VerifiersEnv", "kwargs": {"env_id": env_id}}
        if mixed:
            env = {"class": "distrl.standards.mixture:Mixture", "kwargs": {"envs": {"v": env}}}
        return from_dict({"model": {"path": str(tiny_model_dir)},
                          "data": {"function": "distrl.standards.verifiers:rows", "kwargs": {"env_id": env_id}},
                          "env": {**env, "tool_parser": tool_parser},
                          "run": {"output_dir": str(tmp_path)}, "cluster": {"backend": "local"}})

    line = (f"env.tool_parser: verifiers environment {TOOLS!r} offers tools (add) and env.tool_parser is null, so "
            f"the model's tool calls would never be parsed and run; set it to the model's tool-call format (e.g. "
            f"hermes for Qwen2.5)")
    for mixed in (False, True):
        with pytest.raises(preflight.PreflightError) as err:
            preflight.check(config(TOOLS, None, mixed))
        assert err.value.problems == [line]
        preflight.check(config(TOOLS, "hermes", mixed))
        preflight.check(config(ARITH, None, mixed))  # no tools: no parser needed
