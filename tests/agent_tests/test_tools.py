"""The tool contract, its registry, and the calculator (hand-worked values; what it refuses and why)."""

from __future__ import annotations

import asyncio
import time

import pytest

from distrl.agents.tools import TOOLS, Tool, ToolResult, resolve_tool, truncate
from distrl.agents.tools.calculator import Calculator, evaluate, format_number


def calc(expression: str) -> ToolResult:
    return asyncio.run(Calculator().call({"expression": expression}))


@pytest.mark.parametrize(("expression", "expected"), [
    ("(3 + 4) * 6", "42"),
    ("6 / 3", "2"),          # an integral float reads as an integer
    ("7 / 2", "3.5"),
    ("7 // 2", "3"),
    ("-7 % 3", "2"),         # Python's sign convention: -7 = 3 * -3 + 2
    ("-2 ** 2", "-4"),       # ** binds tighter than unary minus
    ("2 ** -2", "0.25"),
    ("0.1 + 0.2", "0.3"),    # 15 significant digits hide the binary rounding
    ("1.5e3 + 1", "1501"),
    ("sqrt(16) + abs(-2)", "6"),
    ("log(8, 2)", "3"),
    ("floor(2.7) + ceil(2.1) + round(2.5)", "7"),  # 2 + 3 + 2 (round half to even)
    ("2 ** 100", "1267650600228229401496703205376"),
    ("pi", "3.14159265358979"),
])
def test_calculator_hand_worked_values(expression, expected):
    assert calc(expression) == ToolResult(expected)


@pytest.mark.parametrize("expression", ["import os", "__import__('os').system('true')", "(1).__class__", "x + 1",
                                        "'a' * 3", "True + 1", "1 < 2", "2 ^ 3", "[1, 2]", "1 +",
                                        "-" * 990 + "1"])
def test_calculator_rejects_what_is_not_arithmetic(expression):
    result = calc(expression)
    assert result.error == "bad_arguments"
    assert result.content.startswith("not a valid expression")


@pytest.mark.parametrize("expression", ["9 ** 9 ** 9", "10 ** 100000", "(2 ** 3000) * (2 ** 3000)", "1e308 * 10"])
def test_calculator_refuses_huge_results_at_once(expression):
    start = time.monotonic()
    result = calc(expression)
    assert result.error == "refused"
    assert time.monotonic() - start < 0.5  # refused before computing, not after


@pytest.mark.parametrize(("expression", "kind"), [("1 / 0", "ZeroDivisionError"), ("sqrt(-1)", "ValueError"),
                                                  ("exp(1000)", "OverflowError"), ("sqrt(1, 2)", "TypeError"),
                                                  ("round(5, -3)", "TypeError")])  # no ndigits: see _round
def test_calculator_arithmetic_errors_are_results(expression, kind):
    result = calc(expression)
    assert result.error == "runtime_error"
    assert result.content.startswith(kind)


@pytest.mark.parametrize("arguments", [{}, {"expr": "1"}, {"expression": 1}, {"expression": "1", "x": 2}])
def test_calculator_bad_arguments(arguments):
    result = asyncio.run(Calculator().call(arguments))
    assert result.error == "bad_arguments"
    assert '"expression"' in result.content


def test_calculator_output_is_bounded():
    result = asyncio.run(Calculator(max_output_chars=10).call({"expression": "2 ** 1000"}))
    assert result.error is None
    assert result.content.startswith("1071508607\n[truncated: showing the first 10 of 302 characters]")


def test_format_number_and_evaluate():
    assert format_number(42.0) == "42"
    assert format_number(1e20) == "1e+20"  # too large to be shown exactly as an integer
    assert format_number(-0.5) == "-0.5"
    assert evaluate("2 * (3 + 4)") == 14
    assert isinstance(evaluate("2 * (3 + 4)"), int)


def test_truncate_says_it_truncated():
    assert truncate("abc", 3) == ("abc", False)
    assert truncate("abcdef", 3) == ("abc\n[truncated: showing the first 3 of 6 characters]", True)


def test_schema_is_an_openai_function():
    schema = Calculator().schema()
    assert schema["type"] == "function"
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]


class EchoTool:
    """A user's tool, named by `package.module:Class`."""

    name = "echo"

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix

    def schema(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": "echo", "parameters": {}}}

    async def call(self, arguments: dict) -> ToolResult:
        return ToolResult(self.prefix + str(arguments.get("text")))


def test_resolve_tool_builtin_and_import_path():
    assert set(TOOLS) == {"calculator", "python"}
    calculator = resolve_tool("calculator", {"max_output_chars": 5})
    assert isinstance(calculator, Calculator)
    assert calculator.max_output_chars == 5
    echo = resolve_tool(f"{__name__}:EchoTool", {"prefix": "> "})
    assert isinstance(echo, Tool)
    assert asyncio.run(echo.call({"text": "hi"})) == ToolResult("> hi")


@pytest.mark.parametrize(("spec", "kwargs", "message"), [
    ("nope", None, "must be a built-in (calculator, python) or written 'package.module:Class'"),
    ("no_such_module_xyz:Tool", None, "cannot import module 'no_such_module_xyz'"),
    (f"{__name__}:Missing", None, "has no attribute 'Missing'"),
    (f"{__name__}:TOOLS", None, "is a dict, not a class"),
    ("calculator", {"bogus": 1}, "cannot construct distrl.agents.tools.calculator:Calculator with arguments ['bogus']"),
    (f"{__name__}:ToolResult", {"content": "x"}, "lacks the Tool protocol"),
])
def test_resolve_tool_errors_name_the_problem(spec, kwargs, message):
    with pytest.raises(ValueError, match="tool ") as err:
        resolve_tool(spec, kwargs)
    assert message in str(err.value)
