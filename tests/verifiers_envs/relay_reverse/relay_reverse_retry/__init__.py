"""relay_reverse_retry: the multi-turn variant of relay_reverse (see its docstring to install).

The model reverses a word; while it is wrong, the environment answers "no. reverse: <word>" and
lets it try again, up to `max_attempts` model turns. The conversation lives in the `Env`'s own
`run()` (verifiers 0.4.0's multi-turn surface: one `interaction.turn()` per model turn, as its
TextArena environment does). Rewards: the task's `solved` (weight 0.5, the last reply is the
reversed word) plus `speed` (weight 0.5, 1 / attempts when solved), which `run()` records on the
trace itself: solved at once scores 1.0, on the second try 0.75.
"""

from __future__ import annotations

import verifiers.v1 as vf
from relay_reverse import ReverseData, words

__all__ = ["RetryEnv", "RetryTaskset"]


class RetryTask(vf.Task[ReverseData]):
    @vf.reward(weight=0.5)
    async def solved(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)


class RetryConfig(vf.TasksetConfig):
    num_tasks: int = 2000
    """How many words to build."""
    seed: int = 0
    """Seed of the word order."""
    max_attempts: int = 3
    """Model turns before the environment gives up."""


class RetryTaskset(vf.Taskset[RetryTask, RetryConfig]):
    def load(self) -> list[RetryTask]:
        return [
            RetryTask(
                ReverseData(name=word, prompt=f"reverse: {word}\n", answer=word[::-1]),
                self.config.task,
            )
            for word in words(self.config.num_tasks, self.config.seed)
        ]


class RetryEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class RetryEnv(vf.Env[RetryEnvConfig]):
    async def run(self, task: RetryTask, agents: vf.Agents) -> None:
        max_attempts = self.taskset.config.max_attempts
        word = task.data.name
        attempts, solved = 0, False
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            while not segment.terminated:
                attempts += 1
                solved = segment.last_reply == task.data.answer
                if solved or attempts >= max_attempts:
                    break
                segment = await interaction.turn(f"no. reverse: {word}")
        interaction.trace.record_reward("speed", 1.0 / attempts if solved else 0.0, 0.5)
