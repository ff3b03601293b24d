"""What an inference server agrees to load: only a version this run published, readable and
finite (an older version than the one it serves changes nothing). The checks themselves
(rl/weights/published.py, shared by both backends) directly; then every refusal against one
real embedded server, which must keep serving the same version and the same weights after
each. Also that published weights are fsynced, files and directories."""

from __future__ import annotations

import copy
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from rl.core.auth import token_auth
from rl.core.model import ensure_checkpoint, load_model, publish_weights
from rl.core.rundir import COMPLETE, RunDir, mark_complete, write_checksums
from rl.core.runtime import read_address
from rl.inference.client import InferenceClient
from rl.inference.engines import engine_of
from rl.weights.broadcast import InferenceBroadcaster
from rl.weights.filesystem import FilesystemWaiter
from rl.weights.published import (
    RefusedWeights,
    check_checkpoint,
    published_dir,
    read_checkpoint,
)
from tests.support.runs import TOKEN, embedded_server


def fake_step(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A complete directory holding `tensors` as model.safetensors."""
    folder.mkdir(parents=True)
    save_file(tensors, folder / "model.safetensors")
    write_checksums(folder)  # as the trainer records them
    mark_complete(folder)
    return folder


def refused(call: Any, *args: Any) -> str:
    with pytest.raises(RefusedWeights) as err:
        call(*args)
    return str(err.value)


def test_only_a_published_version_of_this_run_is_accepted(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    weights = {"w": torch.ones(2)}
    step_1 = fake_step(run.weights_for(1), weights)
    outside = fake_step(tmp_path / "elsewhere", weights)
    (run.weights / "step_2").symlink_to(outside, target_is_directory=True)
    run.weights_for(3).mkdir()  # being written: no COMPLETE yet

    assert published_dir(run.root, 1) == step_1.resolve()
    assert published_dir(run.root, 1, str(step_1)) == step_1.resolve()
    assert published_dir(run.root, 1, run.weights / ".." / "weights" / "step_1") == step_1.resolve()
    assert "step_2" in refused(published_dir, run.root, 2)  # a symlink out of the run
    assert "elsewhere" in refused(published_dir, run.root, 1, str(outside))
    assert "step_1" in refused(published_dir, run.root, 3, str(step_1))  # another version's
    for version in (999, 3):
        assert f"version {version} is not published" in refused(published_dir, run.root, version)
    for version in (-7, "1", 1.0, True, None):
        assert repr(version) in refused(published_dir, run.root, version)
    assert "no run directory" in refused(published_dir, None, 1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2])
def test_a_tensor_holding_nan_or_inf_is_refused_by_name(
    tmp_path: Path, bad: float, dtype: torch.dtype
) -> None:
    poisoned = torch.zeros(3, 4)
    poisoned[2, 1] = bad
    tensors = {
        "fine": torch.ones(5).to(dtype),
        "ids": torch.arange(3),
        "layer.w": poisoned.to(dtype),
    }
    folder = fake_step(tmp_path / "step_1", tensors)
    for check in (read_checkpoint, check_checkpoint):
        assert "tensor layer.w holds NaN or Inf" in refused(check, folder)


def test_a_truncated_corrupt_or_linked_file_is_refused(tmp_path: Path) -> None:
    good = fake_step(tmp_path / "good", {"a": torch.randn(64, 64), "ids": torch.arange(4)})
    assert read_checkpoint(good).keys() == {"a", "ids"}
    check_checkpoint(good)
    data = (good / "model.safetensors").read_bytes()
    truncated = fake_step(tmp_path / "truncated", {})
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    pickled = fake_step(tmp_path / "pickled", {})
    torch.save({"a": torch.ones(2)}, pickled / "model.safetensors")
    for folder in (truncated, pickled):
        write_checksums(folder)  # written so by the trainer: refused for what they hold
    linked = fake_step(tmp_path / "linked", {})
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(good / "model.safetensors")
    empty = tmp_path / "empty"
    empty.mkdir()
    write_checksums(empty)
    for folder, reason in [
        (truncated, "not a readable safetensors file"),
        (pickled, "not a readable safetensors file"),
        (linked, "symbolic link"),
        (empty, "no *.safetensors"),
    ]:
        for check in (read_checkpoint, check_checkpoint):
            assert reason in refused(check, folder), folder


REWRITTEN_WHILE_READ = """
import os, sys, torch
from pathlib import Path
from safetensors.torch import save_file
from rl.core.rundir import mark_complete, write_checksums
from rl.weights.published import checked_tensors

folder = Path(sys.argv[1])
folder.mkdir()
tensors = {f"t{i}": torch.full((256, 1024), float(i)) for i in range(8)}
save_file(tensors, folder / "model.safetensors")
write_checksums(folder)
mark_complete(folder)
tensors = checked_tensors(folder)
first = next(tensors)
file = folder / "model.safetensors"
size = file.stat().st_size
file.write_bytes(b"")  # rewritten in place, the same file: truncated, then refilled
second = next(tensors)
file.write_bytes(b"\\0" * size)
rest = dict([first, second, *tensors])
print("read whole:", len(rest), all(bool((t == float(n[1:])).all()) for n, t in rest.items()))
"""


def test_a_version_rewritten_in_place_while_it_is_read_cannot_kill_the_reader(
    tmp_path: Path,
) -> None:
    """A published file truncated and refilled under a server that is reading it: the server
    read it whole before checking it, so it loads the version the trainer recorded (read
    through a memory map, the reader died of SIGBUS)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", REWRITTEN_WHILE_READ, str(tmp_path / "step_1")],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1],
    )  # fmt: skip
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.strip() == "read whole: 8 True"


def test_published_weights_are_fsynced_files_and_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every weight file, the step directory (before the rename) and weights/ (after it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rl.core.model import build_char_tokenizer

    synced: list[tuple[str, bool]] = []  # (path, whether the target existed yet)
    real_fsync = os.fsync
    target = tmp_path / "weights" / "step_3"

    def fsync(fd: int) -> None:
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), target.exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    config = LlamaConfig(vocab_size=64, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    target.parent.mkdir()
    publish_weights(LlamaForCausalLM(config), build_char_tokenizer(64), target)

    tmp = str(target.with_name("step_3.tmp"))
    files = {f.name for f in target.iterdir()}
    assert "model.safetensors" in files and COMPLETE in files
    before_rename = {path for path, renamed in synced if not renamed}
    assert {f"{tmp}/{name}" for name in files} | {tmp} <= before_rename
    assert synced[-1] == (str(target.parent), True)


# --- against a real embedded server -----------------------------------------------------------

GREEDY = {"prompt": ["hello world", "ab"], "max_tokens": 12, "temperature": 0, "logprobs": 1}
SERVED = 1


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """One embedded server serving version 1, and published versions 2.. that it must refuse
    (each broken in its own way), plus a good version 9 to load at the end."""
    with embedded_server(tmp_path_factory) as started:
        run = RunDir(started.run_dir)
        model = load_model(ensure_checkpoint(started.cfg.model))
        with torch.no_grad():
            model.model.norm.weight.neg_()  # different greedy outputs than the base weights
        for version in (0, SERVED, 9):
            publish_weights(model, started.tokenizer, run.weights_for(version))
        outside = started.run_dir.parent / "outside"
        shutil.copytree(run.weights_for(0), outside)
        (run.weights / "step_2").symlink_to(outside, target_is_directory=True)
        with torch.no_grad():
            model.model.norm.weight[3] = float("nan")
        publish_weights(model, started.tokenizer, run.weights_for(3))
        for version, broken in ((4, b"\0" * 100), (5, b"\x80\x04\x95 a pickle")):
            publish_weights(model, started.tokenizer, run.weights_for(version))
            (run.weights_for(version) / "model.safetensors").write_bytes(broken)
        url = read_address(started.run_dir, "inference-0")
        with httpx.Client(base_url=url, auth=token_auth(TOKEN), timeout=60) as client:
            load(client, run.weights_for(SERVED), SERVED).raise_for_status()
            baseline = client.post("/v1/completions", json=GREEDY)
            baseline.raise_for_status()
            yield SimpleNamespace(
                client=client, run=run, outside=outside, baseline=baseline.json(),
                cfg=started.cfg, poisoned=model,
            )  # fmt: skip


def load(client: httpx.Client, path: Path | None, version: Any) -> httpx.Response:
    body = {"version": version} if path is None else {"path": str(path), "version": version}
    return client.post("/admin/load_weights", json=body)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("step", "version", "reason"),
    [
        ("outside", 6, "outside"),  # a complete checkpoint outside the run
        (2, 2, "symbolic link"),  # weights/step_2 links outside the run
        (None, 2, "symbolic link"),
        (SERVED, 999, "is not version 999's"),
        (None, 999, "version 999 is not published"),
        (SERVED, -7, "-7"),
        (None, -7, "-7"),
        (3, 3, "tensor model.norm.weight holds NaN or Inf"),
        (4, 4, "does not match the SHA-256 the trainer recorded"),  # truncated
        (5, 5, "does not match the SHA-256 the trainer recorded"),  # a pickle
    ],
)
def test_a_refused_load_leaves_version_and_weights_serving(
    server: SimpleNamespace, step: Any, version: int, reason: str
) -> None:
    path = server.outside if step == "outside" else step
    if isinstance(step, int):
        path = server.run.weights / f"step_{step}"  # as written: a link stays a link
    response = load(server.client, path, version)
    assert response.status_code == 400, response.text
    assert reason in response.json()["detail"]
    assert server.client.get("/admin/version").json() == {"policy_version": SERVED}
    after = server.client.post("/v1/completions", json=GREEDY)
    assert after.status_code == 200, after.text
    assert after.json()["choices"] == server.baseline["choices"]
    assert after.json()["policy_version"] == SERVED


@pytest.mark.slow
def test_an_older_published_version_loads_when_asked(server: SimpleNamespace) -> None:
    """A server serves the version the orchestrator asks for, an older one too: a restarted
    server comes back on the newest, and the fixed schedule may want the one before it."""
    response = load(server.client, server.run.weights_for(0), 0)
    assert response.status_code == 200, response.text
    assert response.json()["policy_version"] == 0
    after = server.client.post("/v1/completions", json=GREEDY).json()
    assert after["choices"] == server.baseline["choices"]  # version 0 holds the same weights
    assert after["policy_version"] == 0
    load(server.client, server.run.weights_for(SERVED), SERVED).raise_for_status()


@pytest.mark.slow
def test_the_orchestrator_skips_a_version_inference_refuses(
    server: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    """A corrupt published version is refused by the server (400); the orchestrator's waiter
    logs it and goes on generating with the version held, rather than ending the run."""
    client = InferenceClient(server.run.root, ["inference-0"], TOKEN, "tiny")
    client.version = SERVED
    log = logging.getLogger("orchestrator")
    waiter = FilesystemWaiter(server.run.root, client, log, timeout_s=30, exact=True)
    with caplog.at_level(logging.WARNING, logger="orchestrator"):
        assert waiter.wait(4, SERVED) == SERVED  # truncated
        assert waiter.wait(5, SERVED) == SERVED  # a pickle
        assert waiter.wait(4, SERVED) == SERVED  # known refused: not asked again
        # A restarted orchestrator holds nothing: it loads the newest older version that
        # loads (4, 3 and 2 are refused), rather than end the run again.
        restarted = FilesystemWaiter(server.run.root, client, log, timeout_s=30, exact=True)
        assert restarted.wait(5, -1) == SERVED
    warned = [r.getMessage() for r in caplog.records if "refused by inference" in r.getMessage()]
    assert len(warned) == 3 and "version 4 refused by inference, skipped" in warned[0]
    assert f"version 5 refused by inference, skipped: loaded version {SERVED} instead" in warned[2]
    assert "does not match the SHA-256" in warned[0]
    assert client.version == SERVED
    assert server.client.get("/admin/version").json() == {"policy_version": SERVED}
    choices = server.client.post("/v1/completions", json=GREEDY).json()["choices"]
    assert choices == server.baseline["choices"]


@pytest.mark.slow
def test_a_published_newer_version_loads_by_number(server: SimpleNamespace) -> None:
    """After all the refusals the server still loads: by version alone, or with its path."""
    for body in ({"version": 9}, {"version": 9, "path": str(server.run.weights_for(9))}):
        response = server.client.post("/admin/load_weights", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["policy_version"] == 9
    assert server.client.get("/admin/version").json() == {"policy_version": 9}


@pytest.mark.slow
def test_a_broadcast_holding_nan_is_refused_by_name(server: SimpleNamespace) -> None:
    """The trainer's broadcast is checked as a load from disk is: the old weights keep serving."""
    cfg = copy.deepcopy(server.cfg)
    cfg.inference.broadcast_timeout_s = 30
    served = server.client.get("/admin/version").json()
    before = server.client.post("/v1/completions", json=GREEDY).json()["choices"]
    sender = InferenceBroadcaster(
        server.run.root,
        cfg,
        logging.getLogger("test"),
        checkpoint_layout=engine_of(cfg).checkpoint_layout,
    )
    with pytest.raises(RuntimeError, match="tensor model.norm.weight holds NaN or Inf"):
        sender.publish(served["policy_version"] + 1, server.poisoned)
    assert server.client.get("/admin/version").json() == served
    assert server.client.post("/v1/completions", json=GREEDY).json()["choices"] == before


def checked_front(private: Path) -> Any:
    """The vLLM front's load path with vLLM itself replaced: records what reaches the swap."""
    from rl.inference.vllm.front import VllmFrontend

    class CheckedFront(VllmFrontend):
        def __init__(self) -> None:  # none of vLLM: the state the load path reads
            import asyncio
            import logging

            self.version, self.loaded, self.weights = -1, [], None
            self.model_name, self.adapters, self.shared, self.base_points = "tiny", {}, False, {}
            self.asleep, self.private, self.copies = False, private, 0
            self.swap, self.ready = asyncio.Lock(), asyncio.Event()
            self.ready.set()
            self.logger = logging.getLogger("test")

        async def _swap_weights(self, path: Path, version: int) -> dict:
            self.loaded.append((version, path))
            self.version, self.weights = version, (path, version)
            return {"policy_version": version}

    return CheckedFront()


def test_the_vllm_front_refuses_what_the_embedded_engine_refuses(tmp_path: Path) -> None:
    """And loads a checked private copy, which it keeps while it serves it (to load again
    after a restart), never the run's files (vLLM would read them after the check)."""
    from fastapi.testclient import TestClient

    from rl.inference.vllm.front import build_app

    run = RunDir(tmp_path / "run")
    for version, value in ((1, 1.0), (2, float("nan")), (3, 1.0)):
        fake_step(run.weights_for(version), {"w": torch.full((2,), value)})
    changed = fake_step(run.weights_for(4), {"w": torch.ones(2)})
    (changed / "model.safetensors").write_bytes(b"\0" * 64)
    front = checked_front(tmp_path / "private")
    front.private.mkdir()
    admin = token_auth(TOKEN).header("/admin/load_weights")  # the orchestrator's admin key
    client = TestClient(build_app(front, TOKEN, run.root), headers=admin)
    for body, status in [
        ({"version": 1, "path": str(run.weights_for(1))}, 200),
        ({"version": 2}, 400),  # NaN
        ({"version": 4}, 400),  # changed since the trainer recorded it
        ({"version": 999}, 400),
        ({"version": -7}, 400),
        ({"version": 3, "path": str(tmp_path)}, 400),
        ({"version": 3}, 200),
        ({"version": 1}, 200),  # older than served: loaded as asked
    ]:
        assert client.post("/admin/load_weights", json=body).status_code == status, body
    assert [v for v, _ in front.loaded] == [1, 3, 1]
    assert all(path.parent == front.private for _, path in front.loaded)
    assert list(front.private.iterdir()) == [front.loaded[-1][1]]  # the one it serves
    assert torch.equal(read_checkpoint(front.loaded[-1][1], recorded=False)["w"], torch.ones(2))
