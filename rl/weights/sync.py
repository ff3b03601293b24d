"""Weight broadcast: trainer rank 0 sends each new policy to every inference worker, no disk.

The two ends meet in a process group of their own, built directly from a TCPStore that rank 0
hosts: the trainer's default group is its FSDP world and every vLLM worker has its own, so
neither can carry this traffic. Rank 0 is the trainer; each receiver takes the next free rank
from a counter in the store and counts itself in under its server's name, so the sender can
say which server never joined. The backend is a parameter: NCCL on GPUs, gloo on CPU; the same
code moves the same bytes over either.

One update on the wire: the header's length (int64), the header (JSON: version, then name,
dtype and shape of every tensor), then the tensors' bytes in buckets of at most
`BUCKET_BYTES` (a larger tensor travels alone, straight from its own memory), each tensor at a
16-byte-aligned offset, then the SHA-256 of every bucket's bytes (32 bytes) that the sender
computed as it sent them: the receiver computes its own as they arrive and refuses an update
whose digest differs (`CorruptUpdate`). Both
ends derive the bucket layout from the header, so only bytes travel: every dtype (bfloat16,
fp8, integers) arrives bit-identical, and memory stays bounded by a bucket on the sender and
by what the consumer keeps on the receiver (vLLM loads layer by layer).

This module imports only torch and the standard library: vLLM loads `VllmWorkerExtension` into
its workers, inside vLLM's own environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Bytes per bucket, by backend: NCCL moves large buffers best; on CPU, small buckets stay in
# cache and reuse memory (measured here: 134 MB in 0.4-0.5 s with 64 MB buckets, 0.1-0.2 s
# with 2-4 MB).
BUCKET_BYTES = {"nccl": 256 << 20, "gloo": 4 << 20}
ALIGN = 16  # bytes: any dtype can be viewed at such an offset
DIGEST_BYTES = 32  # SHA-256


class CorruptUpdate(ValueError):
    """An update whose bytes are not those the sender sent (its digest differs)."""


def _hash(digest: Any, flat: torch.Tensor) -> None:
    """Add a bucket's bytes to `digest` (a GPU bucket is copied to host memory first)."""
    digest.update(memoryview(flat.cpu().numpy()))


BACKENDS = ("gloo", "nccl")
POLL_S = 0.05


@dataclass(frozen=True)
class WeightGroupSpec:
    """How to join one weight group; the sender makes a fresh one whenever membership changes."""

    host: str
    port: int
    world_size: int
    backend: str
    timeout_s: float
    group: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WeightGroupSpec:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _dtype(self.dtype).itemsize * _numel(self.shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight header names an unknown dtype {name!r}")
    return dtype


def buckets(specs: list[TensorSpec], limit: int) -> list[tuple[int, list[int]]]:
    """The buckets an update travels in: (size in bytes, offset of each tensor), in order."""
    out: list[tuple[int, list[int]]] = []
    size, offsets = 0, []  # size: where the next tensor would start
    for spec in specs:
        start = -(-size // ALIGN) * ALIGN
        if offsets and start + spec.nbytes > limit:
            out.append((size, offsets))
            start, offsets = 0, []
        offsets.append(start)
        size = start + spec.nbytes
    if offsets:
        out.append((size, offsets))
    return out


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"weight broadcast backend {backend!r}: valid: {', '.join(BACKENDS)}")


def _store_key(spec: WeightGroupSpec, key: str) -> str:
    return f"relay-weights/{spec.group}/{key}"


def open_group(spec: WeightGroupSpec, store: dist.Store, rank: int) -> dist.ProcessGroup:
    """This process's member of the group `spec` names (blocks until every rank is there)."""
    prefixed = dist.PrefixStore(_store_key(spec, "pg"), store)
    timeout = timedelta(seconds=spec.timeout_s)
    _check_backend(spec.backend)
    make = dist.ProcessGroupNCCL if spec.backend == "nccl" else dist.ProcessGroupGloo
    try:
        return make(prefixed, rank, spec.world_size, timeout)
    except dist.DistStoreError as err:
        raise TimeoutError(
            f"weight group {spec.group}: not all {spec.world_size} ranks arrived within "
            f"{spec.timeout_s:g} s (this is rank {rank})"
        ) from err


class _Member:
    """One end of a weight group: collectives on byte buffers on the backend's device."""

    def __init__(self, spec: WeightGroupSpec, pg: dist.ProcessGroup) -> None:
        self.spec, self.pg = spec, pg
        self.device = torch.device("cpu")
        if spec.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def broadcast(self, buffer: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.pg.broadcast([buffer], options).wait()

    def empty(self, size: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=self.device)


class WeightSender(_Member):
    """Rank 0: hosts the store receivers join through and broadcasts updates (a member of
    the group `join` last formed)."""

    def __init__(self, host: str, backend: str, timeout_s: float) -> None:
        _check_backend(backend)
        self.host, self.backend, self.timeout_s = host, backend, timeout_s
        self.bucket_bytes = BUCKET_BYTES[backend]
        self.store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )

    def new_group(self, receivers: int) -> WeightGroupSpec:
        """A fresh group for this many receivers (plus this rank)."""
        group = uuid.uuid4().hex[:12]
        return WeightGroupSpec(
            self.host, self.store.port, receivers + 1, self.backend, self.timeout_s, group
        )

    def join(self, spec: WeightGroupSpec, members: dict[str, int]) -> None:
        """Form the group once each member (a server's name) has its receivers in, or fail
        naming those that are missing after `timeout_s`."""
        deadline = time.monotonic() + spec.timeout_s
        while True:
            joined = self.joined(spec, list(members))
            if all(joined[name] >= count for name, count in members.items()):
                break
            if time.monotonic() > deadline:
                missing = ", ".join(
                    f"{name} ({joined[name]} of {count} receivers)"
                    for name, count in members.items()
                    if joined[name] < count
                )
                raise TimeoutError(
                    f"weight broadcast: {missing} did not join the {spec.backend} group "
                    f"within {spec.timeout_s:g} s"
                )
            time.sleep(POLL_S)
        super().__init__(spec, open_group(spec, self.store, 0))

    def joined(self, spec: WeightGroupSpec, names: list[str]) -> dict[str, int]:
        """How many receivers of each named server have joined the group so far."""
        return {name: self.store.add(_store_key(spec, f"joined/{name}"), 0) for name in names}

    def send(self, version: int, tensors: dict[str, torch.Tensor]) -> int:
        """Broadcast one update (header, then bucket by bucket); returns the bytes sent."""
        return self.send_stream(version, specs_of(tensors), iter(tensors.values()))

    def send_stream(
        self, version: int, specs: list[TensorSpec], values: Iterator[torch.Tensor]
    ) -> int:
        """Broadcast one update whose tensors `specs` announces, taking each from `values` only
        as its bucket is filled (a sharded trainer gathers them block by block); a value that
        is not what its spec says fails the update before its bucket is sent."""
        header = {
            "version": version,
            "bucket_bytes": self.bucket_bytes,
            "tensors": [[s.name, s.dtype, list(s.shape)] for s in specs],
        }
        encoded = json.dumps(header).encode()
        self.broadcast(torch.tensor([len(encoded)], dtype=torch.int64, device=self.device))
        self.broadcast(torch.frombuffer(bytearray(encoded), dtype=torch.uint8).to(self.device))
        index, total = 0, 0
        digest = hashlib.sha256()
        for size, offsets in buckets(specs, self.bucket_bytes):
            taken = [_matching(specs[index + k], next(values, None)) for k in range(len(offsets))]
            alone = taken[0]
            if len(offsets) == 1 and alone.is_contiguous() and alone.device == self.device:
                flat = _as_bytes(alone)  # no copy
            else:
                flat = self.empty(size)
                for tensor, offset in zip(taken, offsets, strict=True):
                    raw = _as_bytes(tensor)
                    flat[offset : offset + raw.numel()].copy_(raw)
            self.broadcast(flat)
            _hash(digest, flat)
            index += len(offsets)
            total += size
        trailer = torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8)
        self.broadcast(trailer.to(self.device))
        return total


def specs_of(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    """What a header announces of each tensor: name, dtype, shape (meta tensors too)."""
    return [
        TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape))
        for name, t in tensors.items()
    ]


def _matching(spec: TensorSpec, tensor: torch.Tensor | None) -> torch.Tensor:
    if tensor is None:
        raise ValueError(f"weight update: no tensor came for {spec.name}, which it announced")
    got = (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
    if got != (spec.dtype, spec.shape):
        raise ValueError(
            f"weight update: {spec.name} came as {got[0]} {list(got[1])}, announced as "
            f"{spec.dtype} {list(spec.shape)}"
        )
    return tensor


class WeightReceiver(_Member):
    """A receiving rank: joins the group `spec` names and takes updates from rank 0."""

    def __init__(self, spec: WeightGroupSpec, member: str) -> None:
        store = dist.TCPStore(
            spec.host, spec.port, is_master=False, timeout=timedelta(seconds=spec.timeout_s)
        )
        rank = store.add(_store_key(spec, "next_rank"), 1)
        if rank >= spec.world_size:
            raise RuntimeError(
                f"weight group {spec.group} is full ({spec.world_size} ranks): {member} has "
                f"more receivers than it reported"
            )
        store.add(_store_key(spec, f"joined/{member}"), 1)
        super().__init__(spec, open_group(spec, store, rank))
        self.rank = rank

    def receive(self, load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any]) -> dict:
        """Take one update, handing its tensors to `load` as they arrive; returns the version,
        tensor count and bytes. What `load` leaves unread is still received, so the group stays
        in step when it fails (its error is raised after). `CorruptUpdate` when the bytes'
        digest is not the sender's: `load` has then seen tensors it must not keep."""
        size = self.empty(1, torch.int64)
        self.broadcast(size)
        encoded = self.empty(int(size.item()))
        self.broadcast(encoded)
        header = json.loads(encoded.cpu().numpy().tobytes())
        specs = [TensorSpec(n, d, tuple(s)) for n, d, s in header["tensors"]]
        digest = hashlib.sha256()
        stream = self._tensors(specs, header["bucket_bytes"], digest)
        try:
            load(stream)
        finally:
            for _ in stream:
                pass
            trailer = self.empty(DIGEST_BYTES)
            self.broadcast(trailer)
        if bytes(trailer.cpu().numpy()) != digest.digest():
            raise CorruptUpdate(
                f"broadcast of version {header['version']}: its bytes' SHA-256 is not the one "
                "the trainer sent (corrupted on the way): refused"
            )
        nbytes = sum(size for size, _ in buckets(specs, header["bucket_bytes"]))
        return {"version": header["version"], "tensors": len(specs), "bytes": nbytes}

    def _tensors(
        self, specs: list[TensorSpec], limit: int, digest: Any
    ) -> Iterator[tuple[str, torch.Tensor]]:
        index = 0
        for size, offsets in buckets(specs, limit):
            flat = self.empty(size)  # a fresh buffer each time: the consumer may keep views
            self.broadcast(flat)
            _hash(digest, flat)
            for offset in offsets:
                spec = specs[index]
                raw = flat[offset : offset + spec.nbytes]
                yield spec.name, raw.view(_dtype(spec.dtype)).view(spec.shape)
                index += 1


def finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors, each checked for NaN and Inf before it is passed on (a ValueError naming
    the first that holds one)."""
    for name, tensor in tensors:
        values = tensor.to(torch.float16) if tensor.element_size() == 1 else tensor
        if tensor.is_floating_point() and not bool(torch.isfinite(values).all()):
            raise ValueError(f"broadcast tensor {name} holds NaN or Inf: refused")
        yield name, tensor


class VllmWorkerExtension:
    """Relay's methods on every vLLM worker (`--worker-extension-cls
    rl.weights.sync.VllmWorkerExtension`), called through vLLM's collective_rpc."""

    def relay_weight_receiver(self) -> dict:
        """Who answers: one entry per worker, so the server can count its receivers."""
        return {"pid": os.getpid()}

    def init_weight_group(self, spec: str, member: str) -> None:
        """Join the weight group `spec` (JSON) as one of server `member`'s receivers."""
        self.relay_receiver = None  # leave an old group before joining the next
        self.relay_receiver = WeightReceiver(WeightGroupSpec.from_json(spec), member)

    def receive_weights(self) -> dict:
        """Take one update and load it in place through vLLM's own reload (which shards,
        renames and quantises checkpoint-format weights as they stream in)."""
        receiver: WeightReceiver | None = getattr(self, "relay_receiver", None)
        if receiver is None:
            raise RuntimeError("receive_weights before init_weight_group")
        reload = self.reload_weights  # type: ignore[attr-defined]  # vLLM's Worker method
        header = receiver.receive(lambda tensors: reload(weights_iterator=finite(tensors)))
        self.repack_held_weights()
        return header

    def reload_from(self, weights_path: str) -> None:
        """Load a published version's directory in place (vLLM's own reload)."""
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        self.repack_held_weights()

    def repack_held_weights(self) -> int:
        """On CPU, vLLM packs each layer's weights into a oneDNN kernel when it loads them, and
        an in-place reload repacks the layers it loads. An LM head tied to the embedding is not
        in a checkpoint, so it is never reloaded and its kernel kept the old embedding (greedy
        answers off after a weight update, where the CPU has oneDNN's packed path). Repack
        every layer that still holds its weight; returns how many (none off CPU)."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 0
        repacked = 0
        for module in self.model_runner.get_model().modules():  # type: ignore[attr-defined]
            weight = getattr(module, "weight", None)
            held = isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.numel() > 0
            if held and hasattr(module, "cpu_linear"):
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                repacked += 1
        return repacked
