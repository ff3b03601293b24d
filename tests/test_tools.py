"""Tool calling: the Hermes call parser on well-formed and malformed turns, and the one chat
renderer (rl/core/chat.py) rendering tools and tool turns for templates with and without
native tool support, and for tokenizers without a template."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rl.core.chat import CHATML, PLAIN, ChatTemplate
from rl.core.model import build_char_tokenizer
from rl.envs.code_repair.tools import Tool, ToolCall, parse_tool_calls

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


@pytest.fixture
def chatml_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer without a template whose vocabulary has ChatML's markers."""
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tokenizer


def opening(template: ChatTemplate) -> str:
    messages = [
        {"role": "system", "content": "Be careful."},
        {"role": "user", "content": "Fix it."},
    ]
    return template.render(messages, [READ.schema()], generation=True)


def test_a_character_tokenizer_gets_the_plain_template(tokenizer: Any) -> None:
    """Its vocabulary has no ChatML markers (they would be unknown characters): turns are
    `role: text`, each model turn ended with its end-of-sequence token."""
    chat = ChatTemplate(tokenizer)
    assert chat.template == PLAIN and not chat.native_tools
    text = opening(chat)
    assert text.startswith("<bos>system: Be careful.\n\nYou can call tools.")
    assert json.dumps(READ.schema()) in text and text.endswith("user: Fix it.\nassistant: ")
    tool_turn = chat.after_turn([{"role": "tool", "content": "r1"}], [READ.schema()])
    assert tool_turn == "\ntool: r1\nassistant: "


def test_a_template_without_tools_gets_them_in_the_system_message(chatml_tokenizer: Any) -> None:
    chat = ChatTemplate(chatml_tokenizer)
    assert not chat.native_tools and chat.template == CHATML
    text = opening(chat)
    assert text.startswith("<|im_start|>system\nBe careful.\n\nYou can call tools.")
    assert json.dumps(READ.schema()) in text and "<tool_call>" in text
    assert text.endswith("<|im_start|>user\nFix it.<|im_end|>\n<|im_start|>assistant\n")


def test_tool_turns_follow_the_template(chatml_tokenizer: Any) -> None:
    results = [{"role": "tool", "content": r} for r in ("r1", "r2")]
    turn = ChatTemplate(chatml_tokenizer).after_turn(results, [READ.schema()])
    expected = "<|im_start|>tool\nr1<|im_end|>\n<|im_start|>tool\nr2<|im_end|>\n"
    assert turn == "<|im_end|>\n" + expected + "<|im_start|>assistant\n"
    chatml_tokenizer.eos_token = "<|im_end|>"  # a chat tokenizer: the model's turn ends with it
    assert ChatTemplate(chatml_tokenizer).after_turn(results, [READ.schema()]) == (
        "\n" + expected + "<|im_start|>assistant\n"
    )


def test_a_template_with_tools_renders_them_itself(tokenizer: Any) -> None:
    tokenizer.chat_template = NATIVE
    tokenizer.eos_token = "<|im_end|>"
    chat = ChatTemplate(tokenizer)
    assert chat.native_tools
    text = opening(chat)
    assert "You can call tools" not in text
    assert json.dumps(READ.schema()) in text
    assert chat.after_turn([{"role": "tool", "content": "out"}], [READ.schema()]) == (
        "\n<|im_start|>user\n<tool_response>\nout\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
