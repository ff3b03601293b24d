"""The weight transport's two ends, as interfaces.

The trainer and the orchestrator hold one of each (made by rl/weights/factory.py) and never
branch on the transport:
- trainer rank 0: `publisher.wanted(v)` (is there anything left to do for version v, e.g. after
  a restart) and `publisher.publish(v, model, tokenizer, state)`;
- orchestrator: `waiter.wait(minimum, held)` blocks until every inference server holds a
  version >= minimum and returns the version they hold.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

# The inference servers' broadcast routes (rl/weights/routes.py), and the longest a status
# request is held open there.
BROADCAST_ROUTE = "/admin/weights/broadcast"
MAX_STATUS_WAIT_S = 30.0


class RefusedVersion(RuntimeError):
    """Inference refused to load a published version (corrupt, truncated, a symbolic link,
    non-finite): it keeps serving the version it held, and the orchestrator skips this one."""


class WeightPublisher(ABC):
    """Trainer rank 0's end: makes policy version N available to inference."""

    def wanted(self, version: int) -> bool:
        """Whether publishing `version` still has work to do (every rank asks rank 0 before
        the collective that gathers sharded weights)."""
        return True

    @abstractmethod
    def publish(
        self, version: int, model: Any, tokenizer: Any, state: dict[str, Any] | BlockSource | None
    ) -> None:
        """Publish `model`'s weights (or its gathered `state`, or its blocks) as `version`."""


class BlockSource(ABC):
    """A sharded model's whole weights, block by block (rl/trainer/streaming.py): what the
    trainer hands a publisher in place of a gathered state dict, so that no rank holds the
    whole model. Names are the HF names of the module's own layout."""

    @abstractmethod
    def meta(self) -> Iterator[dict[str, Any]]:
        """Each block's tensors as meta tensors (names, shapes, dtypes; nothing gathered)."""

    @abstractmethod
    def blocks(
        self, transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None, host: bool = True
    ) -> Iterator[dict[str, Any]]:
        """Each block's tensors, whole (rank 0's walk; the others take part), passed through
        `transform` where they were gathered (the GPU of an NCCL trainer: re-quantization runs
        there), then moved to the host unless `host` is False."""


class VersionWaiter(ABC):
    """The orchestrator's end: waits until inference serves a new enough policy."""

    load_s: float = 0.0
    """Seconds spent loading weights into inference, summed until the orchestrator takes it
    for a batch's record (stays 0 where the trainer sends the weights itself)."""

    @abstractmethod
    def wait(self, minimum: int, held: int) -> int:
        """Block until every server holds a version >= `minimum` (`held` is what they held
        before); returns the version they hold now."""
