"""Exact arithmetic on an expression string: integers and rationals, parsed with ``ast``, never eval.

Grammar (anything else is an error): numbers (``12``, ``3.25``, ``1_000``), parentheses, unary
``-`` and ``+``, binary ``+ - * / // % **``. Values are ``fractions.Fraction``: ``1/3 + 1/6``
is exactly ``1/2``. Bounds keep a hostile expression cheap: its length, its node count, the
exponent (an integer of at most ``max_exponent`` in absolute value) and the size of every
intermediate value (``max_bits`` for numerator and denominator), checked *before* a power is
computed.

What it does not know: tool-call formats or episodes (``engine.envs.tools`` wraps it).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from fractions import Fraction


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be evaluated; the message says why."""


@dataclass(frozen=True)
class CalculatorLimits:
    """Bounds on one expression.

    Fields:
      max_chars: longest expression accepted.
      max_nodes: most syntax-tree nodes (numbers and operators) accepted.
      max_exponent: largest |exponent| of ``**``.
      max_bits: largest bit length of any intermediate numerator or denominator.
    """

    max_chars: int = 512
    max_nodes: int = 256
    max_exponent: int = 1024
    max_bits: int = 4096


_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}


def evaluate(expression: str, limits: CalculatorLimits = CalculatorLimits()) -> Fraction:
    """The exact value of ``expression``; raises ``CalculatorError`` with a reason."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    if len(expression) > limits.max_chars:
        raise CalculatorError(f"the expression is longer than {limits.max_chars} characters")
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    if not text:
        raise CalculatorError("the expression is empty")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        raise CalculatorError(f"cannot parse {expression!r}") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > limits.max_nodes:
        raise CalculatorError(f"the expression has {nodes} parts; the limit is {limits.max_nodes}")
    return _eval(tree.body, limits)


def format_value(value: Fraction) -> str:
    """``42``, ``-7/3``: integers plainly, other rationals as ``p/q``."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _check_size(value: Fraction, limits: CalculatorLimits) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > limits.max_bits:
        raise CalculatorError(f"a value exceeds {limits.max_bits} bits")
    return value


def _eval(node: ast.AST, limits: CalculatorLimits) -> Fraction:
    if isinstance(node, ast.Constant) and not isinstance(node.value, bool):  # True + 1 is not arithmetic
        if isinstance(node.value, float):  # a decimal literal: exact from its text, not the float
            try:
                return _check_size(Fraction(repr(node.value)), limits)
            except (ValueError, OverflowError):
                raise CalculatorError(f"the number {node.value!r} is out of range") from None
        if isinstance(node.value, int):
            return _check_size(Fraction(node.value), limits)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand, limits)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, limits), _eval(node.right, limits)
        return _check_size(_apply(node.op, left, right, limits), limits)
    raise CalculatorError(f"not allowed in an expression: {type(node).__name__}")


def _apply(op: ast.operator, a: Fraction, b: Fraction, limits: CalculatorLimits) -> Fraction:
    if isinstance(op, ast.Add):
        return a + b
    if isinstance(op, ast.Sub):
        return a - b
    if isinstance(op, ast.Mult):
        return a * b
    if isinstance(op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
        raise CalculatorError("division by zero")
    if isinstance(op, ast.Div):
        return a / b
    if isinstance(op, ast.FloorDiv):
        return Fraction(a // b)
    if isinstance(op, ast.Mod):
        return a % b
    # power: integer exponent only, size bounded before computing
    if b.denominator != 1:
        raise CalculatorError("only integer exponents are allowed")
    e = b.numerator
    if abs(e) > limits.max_exponent:
        raise CalculatorError(f"the exponent {e} exceeds {limits.max_exponent}")
    if a == 0 and e < 0:
        raise CalculatorError("division by zero")
    bits = max(a.numerator.bit_length(), a.denominator.bit_length())
    if bits > 1 and (bits - 1) * abs(e) > limits.max_bits:
        raise CalculatorError(f"the result would exceed {limits.max_bits} bits")
    return a**e
