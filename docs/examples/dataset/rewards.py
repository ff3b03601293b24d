"""Reward functions for `environment=dataset` over words.jsonl: plain functions of the prompt,
the completion, the answer and the row's other fields (here `word`), each returning a number in
[0, 1], as TRL's `reward_funcs` are. docs/environments.md runs them."""


def letters_in_place(completion: str, answer: str, **row: object) -> float:
    """The share of the answer's letters the completion has in the right place."""
    said = completion.strip()
    return sum(a == b for a, b in zip(said, answer, strict=False)) / len(answer)


def no_longer(completion: str, word: str, **row: object) -> float:
    """1.0 for a completion no longer than the word, falling to 0 at twice its length."""
    extra = max(0, len(completion.strip()) - len(word))
    return max(0.0, 1.0 - extra / len(word))
