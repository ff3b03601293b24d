"""docs/agents/wordle_agent.py with three bad episodes per orchestrator process, in the first
training batch after an eval of FIRST - 1 episodes: one raises, one hangs, one sends garbage and
returns a reward that is not a number. Every other episode plays well."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import httpx

from rl.orchestrator.agents import load_agent

play_well = load_agent("docs/agents/wordle_agent.py:play")
episodes = itertools.count(1)
lock = threading.Lock()
FIRST = 9


def play(task: Any) -> Any:
    with lock:
        episode = next(episodes)
    if episode == FIRST:
        raise RuntimeError("this agent has a bug")
    if episode == FIRST + 1:
        threading.Event().wait(60)  # past episode_timeout_s
        return 1.0
    if episode == FIRST + 2:
        headers = {"Authorization": f"Bearer {task.api_key}"}
        httpx.post(f"{task.base_url}/chat/completions", content=b"{garbage", headers=headers)
        play_well(task)
        return "a lot"
    return play_well(task)
