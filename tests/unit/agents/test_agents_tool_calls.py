"""Tool-call text as OpenAI `tool_calls` (Qwen's tags, Llama 3's JSON), and back."""

import json

import pytest

from rl3d.agents.tool_calls import call_arguments, parse_tool_calls, render_tool_calls


def _calls(reply):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls]


def test_qwen_calls_and_the_text_around_them():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}\n</tool_call>'
    )
    reply = parse_tool_calls(text, "qwen")
    assert reply.content == "Let me compute."
    assert _calls(reply) == [("calculator", {"expression": "2*3"}), ("search", {"q": "x"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in reply.tool_calls)
    assert len({c["id"] for c in reply.tool_calls}) == 2
    assert parse_tool_calls(text, "auto").content == "Let me compute."


def test_llama3_json_call():
    text = '<|python_tag|>{"name": "calculator", "parameters": {"expression": "7-1"}}'
    reply = parse_tool_calls(text, "llama3")
    assert reply.content is None and _calls(reply) == [("calculator", {"expression": "7-1"})]
    assert _calls(parse_tool_calls('{"name": "f", "arguments": {}}', "auto")) == [("f", {})]


def test_llama3_json_list_is_several_calls():
    text = (
        '[{"name": "calculator", "parameters": {"expression": "2*3"}}, {"name": "search", "parameters": {}}]'
    )
    reply = parse_tool_calls(text, "llama3")
    assert reply.content is None
    assert _calls(reply) == [("calculator", {"expression": "2*3"}), ("search", {})]
    assert len({c["id"] for c in reply.tool_calls}) == 2


@pytest.mark.parametrize(
    "text, fmt",
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>', "qwen"),  # bad JSON
        ('<tool_call>{"arguments": {}}</tool_call>', "qwen"),  # no name
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "qwen"),  # arguments not an object
        ('<tool_call>{"name": "f", "arguments": {}}', "qwen"),  # never closed
        ('{"name": "f", "parameters": 3}', "llama3"),
        ("{not json", "llama3"),
        ('[{"name": "f", "parameters": {}}, {"parameters": {}}]', "llama3"),  # one call of the list unnamed
        ("[]", "llama3"),
        ("The answer is 6.", "auto"),
    ],
)
def test_a_malformed_call_comes_back_as_content(text, fmt):
    reply = parse_tool_calls(text, fmt)
    assert reply.content == text and reply.tool_calls == []


def test_rendered_calls_parse_back():
    calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', "qwen").tool_calls
    for fmt in ("qwen", "llama3"):
        assert _calls(parse_tool_calls(render_tool_calls(calls, fmt), fmt)) == [("f", {"a": 1})]
        assert _calls(parse_tool_calls(render_tool_calls(calls * 2, fmt), fmt)) == [("f", {"a": 1})] * 2
    assert (
        render_tool_calls(calls, "qwen", newlines=False)
        == '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    )
    assert call_arguments({"function": {"arguments": "not json"}}) == "not json"
