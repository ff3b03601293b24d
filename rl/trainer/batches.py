"""What one forward/backward pass takes: padded rows for supervised warm-up and RL
micro-batches, and per-token log-probabilities of padded rows (the reference that packed rows,
rl/trainer/packing.py, are held to)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rl.core.chat import ChatTemplate
from rl.core.model import encode_prompt
from rl.core.records import Sample
from rl.envs import Example
from rl.trainer import head

# A one-token sample for a pass that contributes nothing.
IDLE = [Sample([0], [0], [0.0], reward=0.0, advantage=0.0, min_version=0, max_version=0)]


def pad_batch(
    sequences: list[list[int]], completion_starts: list[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask, and a mask over the completion tokens of each row."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    completion = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, (seq, start) in enumerate(zip(sequences, completion_starts, strict=True)):
        ids[row, : len(seq)] = torch.tensor(seq)
        attention[row, : len(seq)] = 1
        completion[row, start : len(seq)] = True
    return ids, attention, completion


def sft_batch(
    tokenizer: Any, examples: list[Example], chat: ChatTemplate | None = None, chat_share: float = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Supervised warm-up rows: BOS + prompt + answer + EOS, with the answer (and EOS) masked
    in as the tokens to learn. With `chat`, the first `chat_share` of the rows have the prompt
    as a user's message, rendered as the chat route renders it, instead."""
    chats = round(chat_share * len(examples)) if chat is not None else 0
    sequences, starts = [], []
    for row, example in enumerate(examples):
        if chat is not None and row < chats:
            prompt = chat_prompt(chat, example.prompt)
        else:
            prompt = encode_prompt(tokenizer, example.prompt)
        answer = tokenizer.encode(example.answer, add_special_tokens=False)
        sequences.append(prompt + answer + [tokenizer.eos_token_id])
        starts.append(len(prompt))
    return pad_batch(sequences, starts, tokenizer.pad_token_id)


def chat_prompt(chat: ChatTemplate, prompt: str) -> list[int]:
    """`prompt` as a user's message, ready for the assistant's turn: what a client sending it
    to /v1/chat/completions has the model continue."""
    message = {"role": "user", "content": prompt.strip()}
    return chat.encode(chat.render([message], None, generation=True))


def token_logprobs(model: Any, ids: torch.Tensor, attention: torch.Tensor) -> tuple[Any, Any]:
    """Log-probability of each token given its prefix (position t scores token t), and the
    entropy of the predicting distribution; position 0 gets 0."""
    if head.enabled(model):
        rows, width = ids.shape[0], ids.shape[1] - 1
        at = torch.arange(rows * width, device=ids.device)
        targets = ids[:, 1:].reshape(-1)
        picked, entropy = head.pair_logprobs(
            model, at // width, at % width, targets, input_ids=ids, attention_mask=attention
        )
        picked, entropy = picked.view(rows, width), entropy.view(rows, width)
    else:
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        logp_all = F.log_softmax(logits, dim=-1)
        picked = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros_like(picked[:, :1])
    return torch.cat([zero, picked], dim=1), torch.cat([zero, entropy], dim=1)


def mini_batch(micro_batches: list[list[int]], j: int, n: int) -> list[list[int]]:
    """Mini-batch `j` of `n` (`algorithm.updates_per_batch`): the j-th of n runs of each packed
    micro-batch's samples, so that each mini-batch keeps the token budget, about 1/n of every
    micro-batch and a group's samples together (they share their prompt's copy); micro-batches
    left empty are dropped."""
    return [part for mb in micro_batches if (part := mb[j * len(mb) // n : (j + 1) * len(mb) // n])]


def micro_batch(part: list[Sample], pad_id: int, device: torch.device) -> dict[str, Any]:
    """One forward/backward pass's tensors for `part`: right-padded ids and attention, the
    mask of the tokens that carry loss (completions, less an environment's turns), the
    inference logprobs and each row's advantage, on `device`; and the sequences and prompt
    lengths the packed forward takes."""
    sequences = [list(s.prompt_ids) + list(s.completion_ids) for s in part]
    ids, attention, completion = pad_batch(sequences, [len(s.prompt_ids) for s in part], pad_id)
    inference_logp = torch.zeros(ids.shape)
    for row, s in enumerate(part):
        start = len(s.prompt_ids)
        inference_logp[row, start : start + len(s.logprobs)] = torch.as_tensor(s.logprobs)
        for begin, end in s.env_spans:  # an environment's turns carry no loss
            completion[row, start + begin : start + end] = False
    tensors = {
        "ids": ids,
        "attention": attention,
        "mask": completion,
        "inference_logprobs": inference_logp,
        "advantages": torch.tensor([float(s.advantage) for s in part]),
    }
    return {
        **{key: t.to(device) for key, t in tensors.items()},
        "sequences": sequences,
        "prompt_lens": [len(s.prompt_ids) for s in part],
    }
