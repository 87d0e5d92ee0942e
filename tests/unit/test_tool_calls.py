"""The tagged-JSON tool-call format: well-formed calls parse, anything else is an error string."""

from __future__ import annotations

import pytest

from engine.envs.tools import CalculatorTool, ToolCallFormat, cap_text, format_tool_call, parse_tool_calls, tool_table


def test_a_formatted_call_parses_back():
    text = "I will compute it.\n" + format_tool_call("calculator", {"expression": "12 * 34"})
    parsed = parse_tool_calls(text)
    assert parsed.error is None
    assert [(c.name, dict(c.arguments)) for c in parsed.calls] == [("calculator", {"expression": "12 * 34"})]


def test_text_without_a_call_has_no_calls():
    parsed = parse_tool_calls("<answer>408</answer>")
    assert not parsed.has_calls


@pytest.mark.parametrize("text, reason", [
    ("<tool_call>{\"name\": \"calculator\", \"arguments\": {}}", "matching"),
    ("<tool_call>not json</tool_call>", "must be JSON"),
    ("<tool_call>[1, 2]</tool_call>", "exactly the keys"),
    ('<tool_call>{"name": "calculator"}</tool_call>', "exactly the keys"),
    ('<tool_call>{"name": "c", "arguments": {}, "x": 1}</tool_call>', "exactly the keys"),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', "must be a string"),
    ('<tool_call>{"name": "c", "arguments": "1+1"}</tool_call>', "must be a string"),
    ("<tool_call>" + "[" * 100_000 + "</tool_call>", "longer than"),
    ('<tool_call>{"name": "c", "arguments": {}}</tool_call>' * 3, "at most 2"),
])
def test_malformed_calls_are_errors_not_exceptions(text, reason):
    parsed = parse_tool_calls(text, ToolCallFormat(max_calls=2))
    assert parsed.calls == ()
    assert parsed.has_calls
    assert reason in parsed.error


def test_deeply_nested_json_within_the_size_cap_is_an_error_not_a_crash():
    parsed = parse_tool_calls("<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>")
    assert parsed.error is not None


def test_tool_arguments_are_checked():
    tool = CalculatorTool()
    assert tool.call({"expression": "2+2"}, time_left_s=1).text == "4"
    for bad in ({}, {"expression": 4}, {"expression": "1", "extra": "x"}):
        result = tool.call(bad, time_left_s=1)
        assert not result.ok and result.text.startswith("error:")


def test_a_calculator_error_is_an_error_result():
    result = CalculatorTool().call({"expression": "1/0"}, time_left_s=1)
    assert not result.ok
    assert result.text == "error: division by zero"


def test_long_answers_are_cut_with_a_marker():
    assert cap_text("x" * 10, 20) == "x" * 10
    cut = cap_text("x" * 100, 20)
    assert cut.startswith("x" * 20) and "truncated" in cut


def test_two_tools_with_one_name_are_refused():
    with pytest.raises(ValueError):
        tool_table([CalculatorTool(), CalculatorTool()])
