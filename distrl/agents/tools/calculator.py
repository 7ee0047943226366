"""`Calculator`: arithmetic on numbers, evaluated from Python's syntax tree with only arithmetic admitted.

Why not `eval` or simpleeval: `eval` runs any Python; simpleeval (the usual library) admits names, strings,
comparisons and attribute access by default and bounds only a power's exponent (4,000,000), so `9**3999999` still
builds a number of millions of digits. Walking `ast` over numbers, + - * / // % **, unary signs and a few `math`
functions is short enough to audit here, and bounds every intermediate integer (`MAX_INT_BITS`) before it is built.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

from distrl.agents.tools.base import DEFAULT_MAX_OUTPUT_CHARS, ToolResult, truncate

__all__ = ["MAX_EXPRESSION_CHARS", "MAX_INT_BITS", "Calculator", "CalculatorRefused", "evaluate", "format_number"]

MAX_EXPRESSION_CHARS = 1000
MAX_INT_BITS = 4000
"""Largest integer result or intermediate, in bits (about 1200 decimal digits): a larger one is refused."""

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
def _round(x: Number) -> int:
    """round(x) to an integer; no `ndigits`: round(5, -10**9) would compute 10**(10**9)."""
    return round(x)


_FUNCTIONS: dict[str, Callable[..., Number]] = {
    "sqrt": math.sqrt, "exp": math.exp, "log": math.log, "sin": math.sin, "cos": math.cos, "tan": math.tan,
    "abs": abs, "floor": math.floor, "ceil": math.ceil, "round": _round,
}
_CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}


class CalculatorRefused(ValueError):
    """The expression is valid arithmetic but its result would be too large to compute or show."""


def _checked(value: Number) -> Number:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorRefused(f"the result has more than {MAX_INT_BITS} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorRefused("the result is not a finite number")
    return value


def _power(base: Number, exponent: Number) -> Number:
    # Refuse before computing: 9**9**9 would take minutes and gigabytes to build only to be refused afterwards.
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0 \
            and exponent * math.log2(abs(base)) > MAX_INT_BITS:
        raise CalculatorRefused(f"{base}**{exponent} has more than {MAX_INT_BITS} bits")
    return base ** exponent


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        return _checked(_power(left, right) if isinstance(node.op, ast.Pow) else _BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS \
            and not node.keywords:
        return _checked(_FUNCTIONS[node.func.id](*(_eval(arg) for arg in node.args)))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise SyntaxError("'^' is not a power here: write a**b")
    raise SyntaxError(f"{ast.unparse(node)!r} is not arithmetic (allowed: numbers, + - * / // % **, parentheses, "
                      f"{', '.join(_CONSTANTS)}, and the functions {', '.join(_FUNCTIONS)})")


def evaluate(expression: str) -> Number:
    """The value of an arithmetic `expression`. Raises SyntaxError for what is not arithmetic, CalculatorRefused for
    too large a result, and ZeroDivisionError / ValueError / OverflowError / TypeError from the arithmetic itself."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise SyntaxError(f"the expression has {len(expression)} characters, more than {MAX_EXPRESSION_CHARS}")
    return _eval(ast.parse(expression.strip(), mode="eval").body)


def format_number(value: Number) -> str:
    """An integral value as an integer ("42", not "42.0"); other floats to 15 significant digits ("0.3" for 0.1+0.2)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.15g}"


class Calculator:
    """Evaluates one arithmetic expression: `{"expression": "(3 + 4) * 6"}` -> "42"."""

    name = "calculator"

    def __init__(self, max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> None:
        self.max_output_chars = max_output_chars

    def schema(self) -> dict:
        return {"type": "function", "function": {
            "name": self.name,
            "description": "Evaluate an arithmetic expression and return its value. Supports + - * / // % ** "
                           "(power), parentheses, decimals, pi, e, and sqrt, exp, log, sin, cos, tan, abs, floor, "
                           "ceil, round.",
            "parameters": {"type": "object", "properties": {
                "expression": {"type": "string", "description": "The expression, e.g. \"(3 + 4) * 6 / 2\"."}},
                "required": ["expression"]}}}

    async def call(self, arguments: dict) -> ToolResult:
        expression = arguments.get("expression") if isinstance(arguments, dict) else None
        if not isinstance(expression, str) or set(arguments) != {"expression"}:
            return ToolResult("calculator takes exactly one argument, \"expression\" (a string); got "
                              f"{truncate(repr(arguments), 200)[0]}", error="bad_arguments")
        try:
            content, error = format_number(evaluate(expression)), None
        except CalculatorRefused as err:
            content, error = f"refused: {err}", "refused"
        except (SyntaxError, RecursionError) as err:
            content, error = f"not a valid expression: {err.msg if isinstance(err, SyntaxError) else err}", \
                "bad_arguments"
        except (ZeroDivisionError, ValueError, OverflowError, TypeError) as err:
            content, error = f"{type(err).__name__}: {err}", "runtime_error"
        return ToolResult(truncate(content, self.max_output_chars)[0], error=error)
