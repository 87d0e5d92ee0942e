"""The calculator: exact rational arithmetic through an ast whitelist, bounded, never eval."""

from __future__ import annotations

from fractions import Fraction

import pytest

from engine.envs.calculator import CalculatorError, CalculatorLimits, evaluate, format_value


@pytest.mark.parametrize("expression, value", [
    ("1234 * 5678", Fraction(7006652)),
    ("(1 + 2) * -3", Fraction(-9)),
    ("1/3 + 1/6", Fraction(1, 2)),
    ("7 // 2", Fraction(3)),
    ("-7 // 2", Fraction(-4)),
    ("7 % 3", Fraction(1)),
    ("2 ** 10", Fraction(1024)),
    ("2 ^ -2", Fraction(1, 4)),
    ("0.1 + 0.2", Fraction(3, 10)),
    ("--5", Fraction(5)),
    ("+4", Fraction(4)),
    ("1_000 * 3", Fraction(3000)),
    ("12 × 3 ÷ 4", Fraction(9)),
])
def test_expressions_evaluate_exactly(expression, value):
    assert evaluate(expression) == value


def test_values_format_as_integers_or_exact_fractions():
    assert format_value(Fraction(42)) == "42"
    assert format_value(Fraction(-7, 3)) == "-7/3"


@pytest.mark.parametrize("expression, reason", [
    ("__import__('os').system('true')", "not allowed"),
    ("open('/etc/passwd')", "not allowed"),
    ("x + 1", "not allowed"),
    ("[1, 2]", "not allowed"),
    ("1 if 1 else 2", "not allowed"),
    ("1 < 2", "not allowed"),
    ("'a' * 3", "not allowed"),
    ("True + 1", "not allowed"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("2 ** 0.5", "integer exponents"),
    ("9 ** 9 ** 9", "exceeds"),
    ("10 ** 100000", "exceeds"),
    ("1e400", "out of range"),
    ("", "empty"),
    ("1 +", "cannot parse"),
    ("(" * 300 + "1" + ")" * 300, "longer than"),
])
def test_disallowed_or_unbounded_expressions_raise_with_a_reason(expression, reason):
    with pytest.raises(CalculatorError, match=reason):
        evaluate(expression)


def test_value_size_is_bounded_for_chained_multiplication():
    big = "*".join(["99999999999999999999"] * 20)
    with pytest.raises(CalculatorError, match="bits"):
        evaluate(big, CalculatorLimits(max_bits=512))


def test_node_count_is_bounded():
    with pytest.raises(CalculatorError, match="parts"):
        evaluate("+".join(["1"] * 200), CalculatorLimits(max_nodes=50))
