"""The `dsaserve` command: subcommands are registered lazily so `--help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys

from dsaserve import __version__

# subcommand -> (module with `main(argv) -> int`, one-line help)
SUBCOMMANDS = {
    "serve": ("dsaserve.server.launch", "start the OpenAI/Anthropic-compatible server"),
    "plan": ("dsaserve.plan_cli", "turn hardware x precision x recipe into a launch command"),
    "bench": ("dsaserve.bench.serving", "benchmark an OpenAI-compatible server"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="dsaserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dsaserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in SUBCOMMANDS:
        parser.parse_args(argv or ["--help"])
        return 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
