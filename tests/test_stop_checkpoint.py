"""A stopped job's checkpoint without the optimiser state (`trainer.stop_checkpoint_optimizer=
false`, issue 38 item 7): a third of the bytes, and it resumes with AdamW's moments at zero."""

from __future__ import annotations

from pathlib import Path

import torch

from rl.trainer.checkpoint import has_optimizer, load_checkpoint, save_checkpoint


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_checkpoint_without_optimizer_state_is_smaller_and_resumes(tmp_path: Path) -> None:
    model, optimizer = trained()
    save_checkpoint(model, optimizer, 7, tmp_path / "full")
    save_checkpoint(model, optimizer, 7, tmp_path / "light", with_optimizer=False)
    size = {name: sum(f.stat().st_size for f in (tmp_path / name).iterdir()) for name in
            ("full", "light")}  # fmt: skip
    assert has_optimizer(tmp_path / "full") and not has_optimizer(tmp_path / "light")
    assert size["light"] < size["full"] / 2
    fresh = torch.nn.Linear(64, 64)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert load_checkpoint(fresh, fresh_optimizer, tmp_path / "light") == 7
    assert torch.equal(fresh.weight, model.weight)
    for state in fresh_optimizer.state.values():  # the moments start again from zero
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
