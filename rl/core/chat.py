"""Chat turns as a model's tokens, and tool calls back out of its text.

The one renderer of conversations: the OpenAI-compatible routes of both inference backends
(rl/inference/openai_api.py), the agents' proxy (rl/orchestrator/agent_proxy.py) and
tool-calling environments (rl/envs/code_repair/) all render through `ChatTemplate`, so a
conversation becomes the same tokens wherever it runs.

- The template is the tokenizer's own chat template. A tokenizer without one gets ChatML when
  its vocabulary has ChatML's markers, else a plain `role: text` template that ends each turn
  with the tokenizer's end-of-sequence token (the tiny model's character tokenizer).
- Tools are passed to a template that renders them itself (Qwen3's); for one that does not,
  their declarations and the call format go into the system message.
- Calls are read in the Hermes format that Qwen3 is trained on and vLLM's `hermes` parser
  reads: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PLAIN = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
CALL_OPEN = "<tool_call>"
MARK = "\x00relay-turn\x00"  # stands for a model turn while the text after it is rendered


def template_for(tokenizer: Any) -> str:
    """The chat template this tokenizer's model is served with."""
    if tokenizer.chat_template:
        return tokenizer.chat_template
    return CHATML if "<|im_start|>" in tokenizer.get_vocab() else PLAIN


class ToolsError(ValueError):
    """Tools or tool calls not in OpenAI's shape; `param` names the first bad one."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


TOOL_SHAPE = '{"type": "function", "function": {"name": ..., "parameters": {...}}}'


def check_tools(tools: Any) -> None:
    """Refuse (ToolsError) tool declarations a template could not render."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise ToolsError("tools", f"a list of tools, each {TOOL_SHAPE}")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ToolsError(f"tools[{i}]", f"a tool is {TOOL_SHAPE}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolsError(f"tools[{i}].function.name", "a non-empty string")
        if not isinstance(function.get("description", ""), str):
            raise ToolsError(f"tools[{i}].function.description", "a string")
        parameters = function.get("parameters", {})
        if not isinstance(parameters, dict) or not isinstance(
            parameters.get("properties", {}), dict
        ):
            raise ToolsError(f"tools[{i}].function.parameters", "a JSON schema object")


def check_tool_calls(messages: list[dict[str, Any]]) -> None:
    """Refuse (ToolsError) a message's `tool_calls` not in OpenAI's shape."""
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls is None:
            continue
        if not isinstance(calls, list):
            raise ToolsError(f"messages[{i}].tool_calls", "a list of calls")
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ToolsError(
                    f"messages[{i}].tool_calls[{j}]",
                    'a call is {"id": ..., "type": "function", "function": {"name": ..., '
                    '"arguments": "<JSON>"}}',
                )
            if not isinstance(function.get("arguments", ""), str | dict):
                raise ToolsError(
                    f"messages[{i}].tool_calls[{j}].function.arguments", "a JSON string"
                )


def tools_prompt(schemas: list[dict[str, Any]]) -> str:
    """Tool declarations and the call format, for a template that cannot render tools."""
    lines = "\n".join(json.dumps(s) for s in schemas)
    first = schemas[0].get("function", schemas[0])
    params = first.get("parameters", {}).get("properties", {})
    example = {"name": first.get("name", ""), "arguments": {p: "..." for p in params}}
    return (
        "You can call tools. Their signatures, one JSON object per line:\n<tools>\n"
        f"{lines}\n</tools>\n"
        "To call one, write a JSON object with the tool name and its arguments inside "
        'tags, one call per pair:\n<tool_call>\n{"name": <tool-name>, "arguments": '
        "<args-object>}\n</tool_call>\n"
        f"For example:\n<tool_call>\n{json.dumps(example)}\n</tool_call>\n"
        "Answer without a tool call when you are done."
    )


class ChatTemplate:
    """One tokenizer's chat template: whole conversations, and the text that follows a model
    turn (what an environment or agent adds after it, up to the next assistant header)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.template = template_for(tokenizer)
        self.native_tools = "tools" in self.template
        self.end = tokenizer.eos_token or ""

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict] | None, generation: bool
    ) -> str:
        """The conversation as the template writes it; ToolsError for tools or calls not in
        OpenAI's shape."""
        check_tools(tools)
        check_tool_calls(messages)
        kwargs: dict[str, Any] = {}
        if tools and self.native_tools:
            kwargs["tools"] = tools
        elif tools:
            messages = with_tools_in_system(messages, tools)
        if not self.native_tools:
            messages = [calls_as_text(m) for m in messages]
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.template,
            add_generation_prompt=generation,
            tokenize=False,
            **kwargs,
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """A conversation's tokens, up to the header of the model's next turn."""
        return self.encode(self.render(messages, tools, generation=True))

    def after_turn(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> str:
        """The text after a model turn that ended with the end-of-turn token: `messages` as the
        template writes them there, then the next assistant header."""
        opening = [{"role": "user", "content": "u"}, {"role": "assistant", "content": MARK}]
        text = self.render([*opening, *messages], tools, generation=True)
        after = text[text.index(MARK) + len(MARK) :]
        return after[len(self.end) :] if self.end and after.startswith(self.end) else after


def with_tools_in_system(messages: list[dict[str, Any]], tools: list[dict]) -> list[dict]:
    """`messages` with the tool declarations appended to the system message (one is added)."""
    text = tools_prompt(tools)
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool calls written into its content in the Hermes format, for
    templates that do not render `tool_calls` themselves."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = []
    for call in calls:
        function = call["function"]
        arguments = parsed_arguments(function.get("arguments", {}))
        written = json.dumps({"name": function["name"], "arguments": arguments})
        blocks.append(f"{CALL_OPEN}\n{written}\n</tool_call>")
    content = "\n".join([message.get("content") or "", *blocks]).strip()
    return {"role": message["role"], "content": content}


def parsed_arguments(arguments: Any) -> Any:
    """A tool call's arguments as an object: OpenAI sends them as a JSON string (some models
    write them so too); a string that is not JSON is returned as it is."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn as an assistant message: its text outside the calls, and the calls."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def parse_turn(text: str) -> ParsedTurn:
    """Hermes tool calls out of a model turn, as OpenAI `tool_calls` (arguments as a JSON
    string). A block that is not a call (not JSON, no name) stays in the content, as text."""
    calls = []

    def take(match: re.Match) -> str:
        try:
            raw = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            return match.group(0)
        args = raw.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": raw["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
        return ""

    rest = CALL.sub(take, text).strip() if CALL_OPEN in text else text
    return ParsedTurn(rest if rest or not calls else None, calls)
