"""A Wordle agent written the way any agent is: against an OpenAI endpoint, with the official
`openai` client, offering the model one tool (`guess`). It knows nothing of Relay beyond the
`task` it is handed; with `environment=wordle_agent`, Relay trains the model behind
`task.base_url` on the games this agent plays (docs/agents.md).

The tool is offered when the model's context (from `models.list()`) has room for its
declaration; the model may call it, or just say a word: the first word of its answer is then
the guess. The game's feedback goes back as the tool's result, or as a user message. A game
that outgrows the context ends there. The reward is the game's own: 1 for a solve, else half
the best guess's letter score (2 per green, 1 per yellow, out of 10).
"""

from __future__ import annotations

import json
import re
from typing import Any

from openai import BadRequestError

from rl.envs.wordle import feedback, letter_score

GUESSES = 6
TOOL_CONTEXT = 2048  # tokens a model's context needs before the tool is offered
GUESS_TOOL = {
    "type": "function",
    "function": {
        "name": "guess",
        "description": "Submit one 5-letter guess; the answer is the feedback per letter.",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string", "description": "five letters"}},
            "required": ["word"],
        },
    },
}


def read_guess(message: Any) -> tuple[str, str | None]:
    """The guess in an assistant message, and the id of the tool call that made it (if any)."""
    for call in message.tool_calls or []:
        if call.function.name == "guess":
            try:
                word = json.loads(call.function.arguments).get("word", "")
            except (json.JSONDecodeError, AttributeError):
                word = ""
            return str(word).strip().lower(), call.id
    first = re.search(r"[a-zA-Z]+", message.content or "")
    return (first.group(0).lower() if first else ""), None


def play(task: Any) -> float:
    client = task.client()  # OpenAI(base_url=task.base_url, api_key=task.api_key), pooled
    (model,) = client.models.list().data
    context = (model.model_extra or {}).get("max_model_len", 0)
    tools = [GUESS_TOOL] if context >= TOOL_CONTEXT else []
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
    best = 0.0
    for turn in range(1, GUESSES + 1):
        try:
            reply = client.chat.completions.create(
                model=task.model,
                messages=messages,
                tools=tools,
                max_completion_tokens=task.max_tokens,
            )
        except BadRequestError as err:
            if err.code == "context_length_exceeded":
                break
            raise
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        guess, call_id = read_guess(message)
        if guess == task.answer:
            return 1.0
        if len(guess) == 5 and guess.isalpha():
            marks = feedback(guess, task.answer)
            best = max(best, letter_score(marks))
            result = f"feedback: {marks}"
        else:
            result = "feedback: not a valid guess; answer with one 5-letter word"
        if call_id is not None:
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
        else:
            messages.append({"role": "user", "content": f"{result}\nguess {turn + 1}:"})
    return 0.5 * best
