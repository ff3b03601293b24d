"""Bodies of the spawned trainer ranks in tests/test_sharded_load.py (gloo on CPU): each builds
the real `rl.trainer.loop.Trainer`, measuring how much its resident memory grew while it did,
and rank 0 compares the whole loaded weights with a reference."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rl.core import fp8
from rl.core import model as model_module
from rl.core.model import empty_model, load_model, publish_weights
from rl.core.safetensors_files import safetensors_files
from rl.trainer.checkpoint import full_state_dict
from rl.trainer.loop import Trainer
from rl.trainer.parallel import local_parameter_bytes


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> int:
    """Make the peak resident size (VmHWM) the current one; returns it, in bytes."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    return _status_kib("VmHWM") * 1024


def build_and_compare(
    rank: int, world: int, init_file: str, run_dir: str, out: str, reference: str
) -> None:
    """Build the trainer; rank 0 saves every rank's resident-memory growth during the build
    and the bytes it holds, with the names of the tensors whose whole loaded value is not
    exactly the `reference` checkpoint's as transformers loads it in the trainer's master
    dtype (and that dtype)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg_dtype, published_dtype = _run_dtypes(run_dir)
    empty_model(reference, dtype=cfg_dtype)  # the model's modules imported before measuring
    before = reset_peak_rss()
    trainer = Trainer(Path(run_dir))
    growth = peak_rss() - before
    held = local_parameter_bytes(trainer.model)
    held += sum(b.numel() * b.element_size() for b in trainer.model.buffers())
    measured = [None] * world
    dist.all_gather_object(measured, (growth, held))
    # Publishing gathers block by block (rl/trainer/streaming.py); files of 16 MB here, so
    # that rank 0's growth tells a block from the whole model.
    model_module.WEIGHTS_FILE_BYTES = 16 << 20
    before = reset_peak_rss()
    trainer.publish(1)
    published = peak_rss() - before
    state = full_state_dict(trainer.model)
    if rank == 0:
        # The same version as the whole gathered state writes it, tensor for tensor.
        whole = Path(out).with_suffix(".whole")
        base = fp8.block_size(trainer.base) and trainer.base
        cast = {k: v.to(getattr(torch, published_dtype)) for k, v in state.items()}
        publish_weights(trainer.model, trainer.tokenizer, whole, state_dict=cast, fp8_base=base)
        streamed, gathered = _tensors(trainer.run_dir.weights_for(1)), _tensors(whole)
        if trainer.model.config.tie_word_embeddings:  # a tied LM head is the embedding
            for name in trainer.model._tied_weights_keys or {}:
                gathered.pop(name, None)
        unlike = sorted(set(streamed) ^ set(gathered))
        unlike += [k for k, v in gathered.items() if k in streamed and not _bits(streamed[k], v)]
        want = load_model(reference, dtype=cfg_dtype)
        wrong = sorted(set(state) ^ set(want.state_dict()))
        wrong += [k for k, v in want.state_dict().items() if k in state and not _same(state[k], v)]
        buffers = dict(want.named_buffers())
        for name, buffer in trainer.model.named_buffers():
            if not _same(buffer.cpu(), buffers[name.replace("._checkpoint_wrapped_module", "")]):
                wrong.append(name)
        torch.save(
            {"measured": measured, "wrong": wrong, "published": published, "unlike": unlike}, out
        )
    dist.destroy_process_group()


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in safetensors_files(folder):
        out.update(load_file(folder / file))
    return out


def _bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and torch.equal(got, want)


def _run_dtypes(run_dir: str) -> tuple[str, str]:
    """The trainer's master dtype (what it loads weights into) and the published one."""
    from rl.core.derive import precision
    from rl.core.runtime import load_run_config

    dtypes = precision(load_run_config(Path(run_dir)))
    return dtypes.master, dtypes.published


# The FP8 block format as DeepSeek-V3 and GLM-5 publish it, written here independently of
# rl/core/fp8.py: the reference arithmetic the loader is checked against.
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
BLOCK = 128


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight as float8_e4m3fn values and one float32 scale per 128 x 128 block
    (edge blocks partial): scale = the block's largest magnitude / 448."""
    rows, cols = weight.shape
    grid = (-(-rows // BLOCK), -(-cols // BLOCK))
    padded = torch.zeros(grid[0] * BLOCK, grid[1] * BLOCK)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid[0], BLOCK, grid[1], BLOCK)
    scales = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    values = (blocks / scales[:, None, :, None]).view_as(padded)[:rows, :cols]
    return values.to(torch.float8_e4m3fn), scales


def dequantize_blocks(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Each FP8 value times its block's scale, in float32."""
    rows, cols = values.shape
    per_element = scales.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return values.float() * per_element[:rows, :cols]


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """The weights the published FP8 checkpoints quantize: the blocks' linear projections
    (not embeddings, LM head, norms or the router)."""
    return tensor.dim() == 2 and name.startswith("model.layers.") and name.endswith("proj.weight")


def write_fp8_checkpoint(source: Path, fp8_dir: Path, reference_dir: Path) -> None:
    """From the float checkpoint `source`: `fp8_dir` in the FP8 block format (two files and an
    index, quantization_config in config.json), and `reference_dir` holding what its weights
    dequantize to by the reference arithmetic (float32, no quantization_config)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    weights = load_file(source / "model.safetensors")
    quantized, reference = {}, {}
    for name, tensor in weights.items():
        if is_quantized(name, tensor):
            values, scales = quantize_blocks(tensor)
            quantized[name], quantized[f"{name}_scale_inv"] = values, scales
            reference[name] = dequantize_blocks(values, scales)
        else:
            quantized[name] = reference[name] = tensor
    for target in (fp8_dir, reference_dir):
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(reference, reference_dir / "model.safetensors", metadata={"format": "pt"})
    names = sorted(quantized)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: quantized[k] for k in keys}, fp8_dir / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (fp8_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))
