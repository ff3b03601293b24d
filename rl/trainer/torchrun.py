"""`python -m rl.trainer.torchrun <torchrun arguments>`: torchrun (`torch.distributed.run`),
with its ranks in its own process group, and a rank's full disk passed on as its exit code.

torchrun starts each rank in a session of its own (its SubprocessHandler passes
`start_new_session=True`), so signalling the trainer role's process group, which is how the
launcher and the Slurm job supervisor stop, freeze and end a role (launcher/clusters/processes.py),
reached torchrun but not its ranks: a SIGSTOP of the role left them training. Here each rank
starts in torchrun's process group instead, so a signal to the role's group reaches every rank
at once; torchrun's own teardown signals each rank by its pid (its handler signalled the rank's
group, which no longer exists). A rank's own children stay in the role's group too.

The override is narrow: torch's elastic agent makes every rank's process through the one name
`torch.distributed.elastic.multiprocessing.api.get_subprocess_handler`, which `main` replaces
with `SameGroupHandler` before it runs torchrun's own `main`. Arguments, rendezvous,
restarts, the SIGTERM a rank gets when torchrun is told to stop, and logs are torchrun's.

A rank that ended on a full disk (rl/core/disk.py's EXIT_CODE, its line already in the log)
makes torchrun's exit status that code too, without torchrun's traceback, so the launcher
ends the run rather than restart the trainer.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing import api
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from rl.core import disk


class SameGroupHandler(SubprocessHandler):
    """torch's handler of one rank's process, started in torchrun's session and process
    group, and signalled by its pid."""

    def _popen(self, args: tuple, env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(args=args, env=env, stdout=self._stdout, stderr=self._stderr)

    def close(self, death_sig: signal.Signals | None = None) -> None:
        self.proc.send_signal(death_sig or signal.SIGTERM)  # nothing when it has ended
        for output in (self._stdout, self._stderr):
            if output:
                output.close()


def main(argv: list[str] | None = None) -> None:
    api.get_subprocess_handler = _same_group_handler  # type: ignore[assignment]
    try:
        torchrun.main(argv)
    except ChildFailedError as err:
        if any(f.exitcode == disk.EXIT_CODE for f in err.failures.values()):
            raise SystemExit(disk.EXIT_CODE) from None
        raise


def _same_group_handler(**kwargs: Any) -> SubprocessHandler:
    return SameGroupHandler(**kwargs)


if __name__ == "__main__":
    main(sys.argv[1:])
