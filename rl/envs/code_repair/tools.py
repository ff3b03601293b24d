"""Tool calling for multi-turn environments: tools as JSON schemas, offered through the model's
chat template (rl/core/chat.py renders them), and calls checked against them.

The call format is the Hermes one that Qwen3's template teaches and vLLM's `hermes` parser
reads: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn.

Malformed calls (not JSON, an unknown tool, missing or ill-typed arguments, an unclosed tag) are
not exceptions for the rollout: each becomes an error line in the tool turn, so the model sees
what was wrong, and is counted in the episode's statistics.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from rl.core.chat import CALL, parsed_arguments

JSON_TYPES = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "array": list,
    "object": dict,
}


@dataclass(frozen=True)
class Tool:
    """One tool: what the model is told (name, description, JSON-schema parameters)."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=dict)
    """Property name -> JSON schema; every property is required."""

    def schema(self) -> dict[str, Any]:
        """The OpenAI/HF function declaration."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": self.parameters,
                    "required": list(self.parameters),
                },
            },
        }


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def parse_tool_calls(text: str, tools: dict[str, Tool]) -> tuple[list[ToolCall], list[str]]:
    """The well-formed calls of a model turn, in order, and an error message for each malformed
    one."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for i, match in enumerate(CALL.finditer(text), start=1):
        try:
            calls.append(_check_call(json.loads(match.group(1)), tools))
        except json.JSONDecodeError as err:
            errors.append(f"tool call {i}: not valid JSON ({err.msg} at char {err.pos})")
        except ValueError as err:
            errors.append(f"tool call {i}: {err}")
    closed = len(re.findall(r"</tool_call>", text))
    if text.count("<tool_call>") > closed:
        errors.append("a <tool_call> was not closed with </tool_call>")
    return calls, errors


def _check_call(raw: Any, tools: dict[str, Tool]) -> ToolCall:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise ValueError('expected {"name": <tool>, "arguments": {...}}')
    name, args = raw["name"], parsed_arguments(raw.get("arguments", {}))
    if isinstance(args, str):
        raise ValueError(f"{name}: arguments are not valid JSON")
    if name not in tools:
        raise ValueError(f"unknown tool {name!r}; tools: {', '.join(tools)}")
    if not isinstance(args, dict):
        raise ValueError(f"{name}: arguments must be an object")
    spec = tools[name].parameters
    missing = [p for p in spec if p not in args]
    if missing:
        raise ValueError(f"{name}: missing {', '.join(missing)}")
    unknown = sorted(set(args) - set(spec))
    if unknown:
        raise ValueError(f"{name}: unknown {', '.join(unknown)}; takes {', '.join(spec) or 'none'}")
    for param, schema in spec.items():
        want = JSON_TYPES.get(schema.get("type", ""), object)
        value = args[param]
        if not isinstance(value, want) or (isinstance(value, bool) and want is int):
            raise ValueError(f"{name}: {param} must be a {schema['type']}")
    return ToolCall(name, args)
