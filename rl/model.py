"""Models and tokenizers in Hugging Face layout: the tiny model is built here, never downloaded.

`ensure_checkpoint(model_cfg)` returns a directory any HF-compatible server (the embedded
engine, vLLM) can load: config.json, model.safetensors and the tokenizer files. The tiny model
gets a character-level tokenizer built with the `tokenizers` library and random weights from a
fixed seed, cached under `$RELAY_CACHE` (default `~/.cache/relay`) by a hash of its config.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
from pathlib import Path
from typing import Any

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
CHARS = string.ascii_lowercase + string.digits + " .,:;!?'-\n"
COMPLETE = "COMPLETE"


def _quiet_transformers() -> None:
    """No progress bars from transformers in role logs (one per weight publish otherwise)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def cache_dir() -> Path:
    return Path(os.environ.get("RELAY_CACHE", Path.home() / ".cache" / "relay"))


def build_char_tokenizer(vocab_size: int) -> Any:
    """A character-level tokenizer: specials, then lowercase letters, digits, punctuation."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = [PAD, BOS, EOS, UNK, *CHARS]
    if len(symbols) > vocab_size:
        raise ValueError(f"model.vocab_size={vocab_size} is below the {len(symbols)} characters")
    vocab = {s: i for i, s in enumerate(symbols)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )


def _hf_config(model_cfg: Any, tokenizer: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(
        model_cfg.model_type,
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_kv_heads,
        head_dim=model_cfg.head_dim,
        max_position_embeddings=model_cfg.context_length,
        tie_word_embeddings=model_cfg.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        architectures=[model_cfg.architecture],
    )


def _fingerprint(model_cfg: Any) -> str:
    keys = ("architecture", "model_type", "num_layers", "hidden_size", "intermediate_size",
            "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size", "context_length",
            "tie_word_embeddings", "dtype")  # fmt: skip
    blob = json.dumps({k: str(model_cfg[k]) for k in keys}, sort_keys=True) + CHARS
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_checkpoint(model_cfg: Any, seed: int = 0) -> Path:
    """The model's checkpoint directory, built (tiny) or located (path) as its config says."""
    if model_cfg.path:
        return Path(model_cfg.path)
    if str(model_cfg.source) != "random":
        raise ValueError(
            f"model={model_cfg.name}: source={model_cfg.source} needs model.path to a local "
            "HF checkpoint (this build has no hub access)"
        )
    target = cache_dir() / "models" / f"{model_cfg.name}-{_fingerprint(model_cfg)}"
    if (target / COMPLETE).exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    tokenizer = build_char_tokenizer(model_cfg.vocab_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_hf_config(model_cfg, tokenizer))
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / COMPLETE).touch()
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(target)
    except OSError:  # another process built it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu") -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device)


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def publish_weights(model: Any, tokenizer: Any, target: Path) -> None:
    """Write an HF-layout checkpoint; the COMPLETE marker is written last, after an fsync."""
    _quiet_transformers()
    tmp = target.with_name(f"{target.name}.tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    marker = tmp / COMPLETE
    with open(marker, "w") as f:
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(target)


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).exists()


def newest_version(weights_dir: Path) -> int:
    """Highest complete `weights/step_N`, or -1."""
    versions = [
        int(p.name.split("_")[1])
        for p in weights_dir.glob("step_*")
        if p.name.split("_")[1].isdigit() and is_complete(p)
    ]
    return max(versions, default=-1)
