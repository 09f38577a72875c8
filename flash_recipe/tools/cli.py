"""The ``flash-recipe`` command line: ``verify | doctor | recipe | bench | warmup | tune | hub-build``.

Each subcommand lives in its own module, which exposes two functions:

- ``add_arguments(parser)``: declares the subcommand's options;
- ``run(args) -> int``: does the work and returns the exit status.

The module is imported only when its subcommand runs, so ``flash-recipe --help`` stays fast and
works without torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .. import __version__

# subcommand -> (module relative to this package, one-line help)
SUBCOMMANDS = {
    "verify": (".verify", "check every backend against the fp32 reference and print a fingerprint"),
    "doctor": ("..env.doctor", "diagnose this environment's FlashAttention install and print the fix"),
    "recipe": ("..env.recipe", "print the recommended install recipe for this environment"),
    "bench": (".bench", "measure attention throughput against torch SDPA and other peers"),
    "warmup": (".warmup", "compile the Triton kernels for the local GPU ahead of time"),
    "tune": (".tune", "time launch configurations on the local GPU and keep the fastest for it"),
    "hub-build": (".hub_build", "write the package as a Hugging Face Hub kernel (build/torch-<backend>/)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flash-recipe",
        description="FlashAttention in Triton: verify, diagnose, install, benchmark.",
    )
    parser.add_argument("--version", action="version", version=f"flash-recipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        args = parser.parse_args(argv)  # prints help/version or a usage error
        parser.print_help()
        return 2
    name = argv[0]
    module_name, help_text = SUBCOMMANDS[name]
    # Every subcommand ships with the package: an import error is a broken install or a bug, and
    # its traceback says which.
    module = importlib.import_module(module_name, __package__)
    sub_parser = argparse.ArgumentParser(prog=f"flash-recipe {name}", description=help_text)
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
