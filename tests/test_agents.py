"""Bring your own agent: agents written with the official `openai` client play episodes through
the proxy (rl/orchestrator/agent_proxy.py) against a real embedded inference server. The recorded
samples must hold exactly the tokens the server sampled, drifted histories must be caught and
counted, and agents that raise, hang or send garbage must end only their own episode. The last test
trains a whole run through this route with docs/agents/wordle_agent.py and misbehaving agents mixed
in."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from rl.core.chat import ChatTemplate
from rl.core.records import Episode
from rl.inference.client import InferenceClient
from rl.orchestrator.advantages import ADVANTAGES
from rl.orchestrator.agent_proxy import AgentProxy
from rl.orchestrator.agents import AgentEnvironment, Task
from rl.orchestrator.scoring import score_group
from tests.support.runs import ROOT, TOKEN, compose_run, embedded_server

pytestmark = pytest.mark.slow
RELEASE = threading.Event()  # set at teardown: ends the "hung" agents' threads


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with embedded_server(tmp_path_factory, "experiment=wordle_agent") as running:
        running.client = InferenceClient(running.run_dir, ["inference-0"], TOKEN, "tiny")
        yield running
    RELEASE.set()


def environment(server: Any, fn: Any, **args: Any) -> AgentEnvironment:
    """The experiment's agent environment with `args` set, playing with `fn` when given."""
    overrides = [f"environment.args.{k}={v}" for k, v in args.items()]
    env = AgentEnvironment(compose_run("experiment=wordle_agent", *overrides).environment)
    env.agent = fn or env.agent
    env.use_tokenizer(server.tokenizer)
    return env


def play(env: AgentEnvironment, server: Any, n: int = 1, temperature: float = 1.0) -> list:
    example = env.train_examples()[0]
    return env.rollouts(server.client, [example], n, temperature, 1024)


def chat(task: Task) -> openai.OpenAI:
    return openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)


def model_spans(choice: Episode) -> list[list[int]]:
    """The completion's model turns: the token runs between the added (masked) spans."""
    ids, spans, at, runs = choice.completion_ids, choice.env_spans, 0, []
    for begin, end in [*spans, [len(ids), len(ids)]]:
        if begin > at:
            runs.append(ids[at:begin])
        at = end
    return runs


def test_recorded_tokens_are_those_sampled_across_turns(server: Any) -> None:
    turns: list[dict[str, Any]] = []

    def agent(task: Task) -> float:
        api = chat(task)
        messages = [{"role": "user", "content": task.prompt}]
        for k in range(3):
            reply = api.chat.completions.create(
                model=task.model, messages=messages, logprobs=True, stream=False
            )
            choice = reply.choices[0]
            turns.append(
                {
                    "prompt": choice.model_extra["prompt_token_ids"],
                    "ids": choice.model_extra["token_ids"],
                    "logprobs": [c.logprob for c in choice.logprobs.content],
                }
            )
            messages.append(choice.message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": f"feedback {k}: xxgyy"})
        return 0.25

    env = environment(server, agent)
    (choice,) = play(env, server)
    assert [t["ids"] for t in turns] == model_spans(choice)  # every sampled token, as sampled
    assert choice.prompt_ids == turns[0]["prompt"]
    whole = choice.prompt_ids + choice.completion_ids
    for turn in turns:  # each turn continued from the exact tokens before it
        assert whole[: len(turn["prompt"])] == turn["prompt"]
        assert whole[len(turn["prompt"]) : len(turn["prompt"]) + len(turn["ids"])] == turn["ids"]
    logprobs = choice.logprobs
    assert len(choice.env_spans) == 2
    for begin, end in choice.env_spans:
        assert logprobs[begin:end] == [0.0] * (end - begin)  # added: no loss
    sampled = [lp for t in turns for lp in t["logprobs"]]
    masked = {i for b, e in choice.env_spans for i in range(b, e)}
    assert [lp for i, lp in enumerate(logprobs) if i not in masked] == pytest.approx(sampled)
    # What the agent added was tokenized once, as the template writes it after a model turn.
    template = ChatTemplate(server.tokenizer)
    begin, end = choice.env_spans[0]
    added = server.tokenizer.decode(choice.completion_ids[begin:end])
    after = template.after_turn([{"role": "user", "content": "feedback 0: xxgyy"}], None)
    assert added.endswith(after)
    transcript = choice.turns
    assert env.score(env.train_examples()[0], transcript) == 0.25
    assert transcript.stats["template_drift"] == 0 and transcript.stats["turns"] == 3


def test_a_refused_turn_leaves_the_episode_as_it_was(server: Any) -> None:
    """A request refused (here: past the context, and text with a lone surrogate) changes
    nothing: the agent's retry continues the conversation as if the refused one had never
    come."""
    seen: dict[str, Any] = {}

    def agent(task: Task) -> float:
        api = chat(task)
        messages = [{"role": "user", "content": task.prompt}]
        reply = api.chat.completions.create(model=task.model, messages=messages)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        try:
            too_long = [*messages, {"role": "user", "content": "x" * 2000}]
            api.chat.completions.create(model=task.model, messages=too_long)
        except openai.BadRequestError as err:
            seen["code"] = err.code
        broken = [*messages, {"role": "user", "content": "x\ud800"}]  # the client cannot send it
        seen["broken"] = httpx.post(
            f"{task.base_url}/chat/completions",
            content=json.dumps({"model": task.model, "messages": broken}),
            headers={"Authorization": f"Bearer {task.api_key}", "Content-Type": "application/json"},
        ).json()["error"]["param"]
        messages.append({"role": "user", "content": "again"})
        second = api.chat.completions.create(model=task.model, messages=messages)
        seen["prompt"] = second.choices[0].model_extra["prompt_token_ids"]
        return 0.0

    (choice,) = play(environment(server, agent), server)
    assert seen["code"] == "context_length_exceeded"
    assert seen["broken"] == "messages[2].content"
    assert choice.turns.stats["template_drift"] == 0 and len(choice.env_spans) == 1
    whole = choice.prompt_ids + choice.completion_ids
    assert whole[: len(seen["prompt"])] == seen["prompt"]
    assert "x" * 20 not in server.tokenizer.decode(whole)


def drifting_agent(turns: list[dict[str, Any]]) -> Any:
    """Two turns; before the second it rewrites its first answer (as a re-rendering agent
    would)."""

    def agent(task: Task) -> None:
        api = chat(task)
        messages = [{"role": "user", "content": task.prompt}]
        for k in range(2):
            reply = api.chat.completions.create(model=task.model, messages=messages)
            choice = reply.choices[0]
            extra = choice.model_extra
            turns.append({"prompt": extra["prompt_token_ids"], "ids": extra["token_ids"]})
            messages.append({"role": "assistant", "content": f"edited {k}"})
            messages.append({"role": "user", "content": "go on"})
        return None

    return agent


def test_episodes_share_one_connection_pool_that_no_agent_closes(server: Any) -> None:
    pools = []

    def agent(task: Task) -> float:
        with task.client() as api:  # closes the client at the end of the episode
            api.chat.completions.create(
                model=task.model, messages=[{"role": "user", "content": task.prompt}]
            )
        pools.append(task.http)
        return 0.5

    env = environment(server, agent, concurrency=1)
    episodes = play(env, server, n=3)
    assert all(e is not None for e in episodes)  # each after the one before closed its client
    assert len(pools) == 3 and all(pool is env.proxy.http for pool in pools)
    assert not env.proxy.http.is_closed


def test_drift_starts_a_new_sample(server: Any) -> None:
    turns: list[dict[str, Any]] = []
    env = environment(server, drifting_agent(turns))  # on_drift: new_sample (the default)
    (choice,) = play(env, server)
    assert choice.turns.stats["template_drift"] == 1
    assert choice.turns.stats["samples"] == 2
    (first,) = choice.earlier
    assert first.prompt_ids == turns[0]["prompt"]
    assert first.completion_ids == turns[0]["ids"]
    # The new sample starts from the request as sent, rendered and tokenized once.
    template = ChatTemplate(server.tokenizer)
    sent = [
        {"role": "user", "content": env.train_examples()[0].prompt},
        {"role": "assistant", "content": "edited 0"},
        {"role": "user", "content": "go on"},
    ]
    assert choice.prompt_ids == template.encode(template.render(sent, None, True))
    assert choice.prompt_ids == turns[1]["prompt"]
    assert choice.completion_ids == turns[1]["ids"]
    # Both samples train, with the episode's reward and advantage.
    example = env.train_examples()[0]
    group = score_group(env, ADVANTAGES["group_mean"], example, [choice, choice], 0.0, 12)
    assert len(group.samples) == 4
    assert len({(s.reward, s.advantage) for s in group.samples}) == 1


def test_keep_sampled_continues_from_the_sampled_tokens(server: Any) -> None:
    turns: list[dict[str, Any]] = []
    env = environment(server, drifting_agent(turns), on_drift="keep_sampled")
    (choice,) = play(env, server)
    assert choice.turns.stats["template_drift"] == 1 and choice.earlier == []
    assert turns[1]["prompt"][: len(turns[0]["prompt"]) + len(turns[0]["ids"])] == (
        turns[0]["prompt"] + turns[0]["ids"]
    )
    assert model_spans(choice) == [t["ids"] for t in turns]


def misbehaving(kind: str) -> Any:
    def agent(task: Task) -> Any:
        api = chat(task)
        hello = [{"role": "user", "content": task.prompt}]
        if kind == "raises_at_once":
            raise RuntimeError("agent bug before any request")
        api.chat.completions.create(model=task.model, messages=hello)
        if kind == "raises":
            raise ValueError("agent bug after a turn")
        if kind == "hangs":
            RELEASE.wait(600)
            return 1.0
        if kind == "garbage":
            url = f"{task.base_url}/chat/completions"
            headers = {"Authorization": f"Bearer {task.api_key}"}
            for body in (b"{not json", b'{"messages": "hi"}', b'{"messages": [{"role": 7}]}'):
                refused = httpx.post(url, content=body, headers=headers, timeout=30)
                assert refused.status_code in (400, 422), refused.text
                assert refused.json()["error"]["message"]
            return "a lot"
        if kind == "out_of_range":
            return 7.5
        return 0.5

    return agent


KINDS = ["raises_at_once", "raises", "hangs", "garbage", "out_of_range", "fine"]


def test_failing_agents_end_only_their_episode(server: Any, caplog: Any) -> None:
    count = iter(range(len(KINDS)))
    lock = threading.Lock()

    def dispatch(task: Task) -> Any:
        with lock:
            kind = KINDS[next(count)]
        return misbehaving(kind)(task)

    env = environment(server, dispatch, episode_timeout_s=15, concurrency=len(KINDS))
    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        choices = play(env, server, n=len(KINDS))
    reasons = "\n".join(r.getMessage() for r in caplog.records)
    for said in ("raised RuntimeError: agent bug before", "raised ValueError: agent bug after",
                 "timed out after 15 s", "returned 'a lot', not a finite number",
                 "outside the tasks' range"):  # fmt: skip
        assert said in reasons
    played = [c for c in choices if c is not None]
    assert len(played) == len(KINDS) - 1  # only the agent that never asked has no sample
    example = env.train_examples()[0]
    rewards = sorted(env.score(example, c.turns) for c in played)
    assert rewards == [0.0, 0.0, 0.0, 0.0, 0.5]
    failed = sorted(c.turns.stats["agent_failed"] for c in played)
    assert failed == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert sum(c.turns.stats["agent_timeout"] for c in played) == 1
    # The proxy still serves the next episode.
    env.agent = misbehaving("fine")
    (again,) = play(env, server)
    assert env.score(example, again.turns) == 0.5


def test_an_agent_without_a_reward_is_scored_by_a_single_turn_tasks_reward(server: Any) -> None:
    """An agent that returns None over a single-turn tasks environment (reverse_text) gets the
    tasks' reward of its last answer. Before, that reward was given the list of turns and
    raised (AttributeError: 'list' object has no attribute 'strip'), ending the orchestrator."""
    answers: list[str] = []

    def agent(task: Task) -> None:
        api = chat(task)
        messages = [{"role": "user", "content": task.prompt}]
        for _ in range(2):  # two turns: the last one is its answer
            said = api.chat.completions.create(model=task.model, messages=messages)
            messages += [{"role": "assistant", "content": said.choices[0].message.content}]
            messages += [{"role": "user", "content": "again"}]
        answers.append(messages[-2]["content"])

    env = environment(server, agent, tasks="reverse_text")
    example = env.train_examples()[0]
    (choice,) = env.rollouts(server.client, [example], 1, 1.0, 1024)
    assert len(choice.turns) == 2 and choice.turns[-1] == answers[0]
    want = env.tasks.score(example, answers[0])
    assert env.score(example, choice.turns) == want
    assert env.exact_match(example, choice.turns) == env.tasks.exact_match(example, answers[0])
    # Only the right answer is exact: the reward reads the last turn, not any turn.
    right = type(choice.turns)(["wrong", example.answer], None, "", {})
    assert env.exact_match(example, right) and env.score(example, right) == 1.0
    assert not env.exact_match(example, type(right)([example.answer, "wrong"], None, "", {}))


def test_a_tasks_environment_that_plays_its_own_episodes_is_refused() -> None:
    from rl.orchestrator.agents import check_config

    with pytest.raises(ValueError, match="environment.args.tasks=agent: it plays its own"):
        cfg = compose_run("experiment=wordle_agent", "environment.args.tasks=agent")
        check_config(cfg.environment)


def test_a_program_agent_gets_its_endpoint_in_the_environment(
    server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its episode's endpoint and key, and none of the run's credentials."""
    monkeypatch.setenv("RELAY_TOKEN", "the-run-token")  # as a role started by the launcher has
    monkeypatch.setenv("RELAY_KEYS", "admin=k")
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os, openai\n"
        "assert not {'RELAY_TOKEN', 'RELAY_KEYS'} & set(os.environ), 'run credentials leak'\n"
        "task = json.loads(os.environ['RELAY_TASK'])\n"
        "api = openai.OpenAI()\n"  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
        "api.chat.completions.create(model=os.environ['OPENAI_MODEL'],"
        " messages=[{'role': 'user', 'content': task['prompt']}])\n"
        "print(0.75 if task['answer'] else 0)\n"
    )
    env = environment(server, None, agent="''", command=f"[{sys.executable},{script}]")
    (choice,) = play(env, server)
    assert env.score(env.train_examples()[0], choice.turns) == 0.75
    assert choice.turns.stats["turns"] == 1


def test_an_episode_key_opens_its_own_open_session_only(server: Any) -> None:
    """Each episode has its own key: another episode's key is refused (401), and a closed
    episode's key opens nothing (404). A body larger than the served length could hold is
    refused before it is read whole (413), and tools or tool calls not in OpenAI's shape are
    a 400 naming them, not a 500."""
    env = environment(server, None)
    proxy = AgentProxy(server.client, server.tokenizer, 1024, env.args)
    proxy.start()
    sampling = {"temperature": 1.0, "max_tokens": 4, "n": 1}
    (mine, my_key), (theirs, their_key) = proxy.open(sampling), proxy.open(sampling)
    body = {"model": proxy.model_name, "messages": [{"role": "user", "content": "hello"}]}

    def post(sid: str, key: str, payload: dict[str, Any]) -> httpx.Response:
        url = f"{proxy.url}/s/{sid}/v1/chat/completions"
        return httpx.post(url, json=payload, headers={"Authorization": f"Bearer {key}"}, timeout=60)

    assert post(theirs, my_key, body).status_code == 401
    assert post(theirs, their_key, body).status_code == 200
    assert proxy.sessions[theirs][0].turns and not proxy.sessions[mine][0].turns
    proxy.close(theirs)
    assert post(theirs, their_key, body).status_code == 404
    huge = {**body, "messages": [{"role": "user", "content": "x" * 8_000_000}]}
    assert post(mine, my_key, huge).status_code == 413
    malformed = {
        "tools[0]": {**body, "tools": [{"type": "function", "function": "guess"}]},
        "messages[1].tool_calls[0]": {
            **body,
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": ["guess"]},
                {"role": "tool", "content": "ok", "tool_call_id": "1"},
            ],
        },
    }
    for param, payload in malformed.items():
        response = post(mine, my_key, payload)
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert post(mine, my_key, body).status_code == 200  # the episode goes on
    proxy.close(mine)


FAULTY = ROOT / "tests" / "agents" / "faulty_wordle.py"


def test_a_run_trains_through_an_agent_with_failing_episodes(tmp_path: Path) -> None:
    """`rl experiment=wordle_agent`, with one episode raising, one hanging and one sending
    garbage: the run finishes, reward is logged every step, and the reasons are in the log."""
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable, "-m", "launcher.cli", "experiment=wordle_agent", "max_steps=3",
            "warmup.steps=20", "environment.eval_size=8", "environment.eval_every=0",
            f"environment.args.agent={FAULTY}:play", "environment.args.episode_timeout_s=20",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "RELAY_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    # Kept groups may or may not hold a failed episode (zero-advantage groups are refilled).
    assert all({"reward/mean", "env/turns", "env/agent_failed"} <= r.keys() for r in train)
    log = (run_dir / "logs" / "orchestrator.log").read_text()
    for said in ("raised RuntimeError", "timed out after 20 s", "not a finite number"):
        assert said in log
