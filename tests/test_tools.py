"""Tool calling: the Hermes call parser on well-formed and malformed turns, and the chat
rendering of tools and tool turns for templates with and without native tool support."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rl.envs.code_repair.tools import CHATML, ChatFormat, Tool, ToolCall, parse_tool_calls
from rl.model import build_char_tokenizer

READ = Tool("read_file", "Read one file.", {"path": {"type": "string"}})
EDIT = Tool("edit_file", "Edit.", {"path": {"type": "string"}, "line": {"type": "integer"}})
TOOLS = {t.name: t for t in (READ, EDIT, Tool("run_tests", "Run.", {}))}
# The shape of Qwen3's template: tools rendered by the template, tool results as user turns.
NATIVE = (
    "{% if tools %}<|im_start|>system\n{{ messages[0]['content'] }}\n<tools>"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages[1:] %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m['content'] }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_well_formed_calls_are_parsed_in_order() -> None:
    text = f"Let me look.\n{call('read_file', path='a.py')}{call('run_tests')} and done"
    assert parse_tool_calls(text, TOOLS) == (
        [ToolCall("read_file", {"path": "a.py"}), ToolCall("run_tests", {})],
        [],
    )


def test_arguments_sent_as_a_json_string_are_accepted() -> None:
    text = '<tool_call>{"name": "read_file", "arguments": "{\\"path\\": \\"b.py\\"}"}</tool_call>'
    assert parse_tool_calls(text, TOOLS) == ([ToolCall("read_file", {"path": "b.py"})], [])


def test_a_turn_without_calls_has_neither_calls_nor_errors() -> None:
    assert parse_tool_calls("All tests pass now.", TOOLS) == ([], [])


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>{name: read_file}</tool_call>", "tool call 1: not valid JSON"),
        (call("delete_everything"), "tool call 1: unknown tool 'delete_everything'"),
        (call("read_file"), "tool call 1: read_file: missing path"),
        (call("read_file", path="a", mode="w"), "tool call 1: read_file: unknown mode"),
        (call("edit_file", path="a", line="3"), "tool call 1: edit_file: line must be a integer"),
        (call("edit_file", path="a", line=True), "tool call 1: edit_file: line must be a integer"),
        ("<tool_call>[1, 2]</tool_call>", 'tool call 1: expected {"name"'),
        ('<tool_call>{"name": "read_file", "arguments": 3}</tool_call>', "must be an object"),
        ('<tool_call>{"name": "run_tests"}', "was not closed"),
    ],
)
def test_malformed_calls_become_error_messages(text: str, error: str) -> None:
    calls, errors = parse_tool_calls(text, TOOLS)
    assert calls == [] and len(errors) == 1 and error in errors[0], errors


def test_good_calls_survive_next_to_bad_ones() -> None:
    text = call("nope") + call("run_tests") + "<tool_call>{oops</tool_call>"
    calls, errors = parse_tool_calls(text, TOOLS)
    assert calls == [ToolCall("run_tests", {})]
    assert [e.split(":")[0] for e in errors] == ["tool call 1", "tool call 3"]


@pytest.fixture
def tokenizer() -> Any:
    return build_char_tokenizer(64)


def test_a_template_without_tools_gets_them_in_the_system_message(tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer, [READ])
    assert not chat.native and chat.template == CHATML
    text = chat.render(chat.opening("Be careful.", "Fix it."), generation=True)
    assert text.startswith("<|im_start|>system\nBe careful.\n\nYou can call tools.")
    assert json.dumps(READ.schema()) in text and "<tool_call>" in text
    assert text.endswith("<|im_start|>user\nFix it.<|im_end|>\n<|im_start|>assistant\n")


def test_tool_turns_follow_the_template(tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer, [READ])
    turn = chat.tool_turn(["r1", "r2"])
    expected = "<|im_start|>tool\nr1<|im_end|>\n<|im_start|>tool\nr2<|im_end|>\n"
    assert turn == "<|im_end|>\n" + expected + "<|im_start|>assistant\n"
    tokenizer.eos_token = "<|im_end|>"  # a chat tokenizer: the model's turn ends with it
    assert ChatFormat(tokenizer, [READ]).tool_turn(["r1", "r2"]) == (
        "\n" + expected + "<|im_start|>assistant\n"
    )


def test_a_template_with_tools_renders_them_itself(tokenizer: Any) -> None:
    tokenizer.chat_template = NATIVE
    tokenizer.eos_token = "<|im_end|>"
    chat = ChatFormat(tokenizer, [READ])
    assert chat.native
    text = chat.render(chat.opening("Be careful.", "Fix it."), generation=True)
    assert "You can call tools" not in text
    assert json.dumps(READ.schema()) in text
    assert chat.tool_turn(["out"]) == (
        "\n<|im_start|>user\n<tool_response>\nout\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
