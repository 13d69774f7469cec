"""The ``caffejax`` command line, mirroring BVLC Caffe's tools.

``caffejax train|test|time|device-query`` are Caffe's ``caffe`` brew commands (tools/caffe.cpp) and take its
flags (``-solver``, ``-model``, ``-weights``, ``-iterations``...; ``--solver`` works too). The rest are Caffe's
other tools: ``draw`` (python/draw_net.py), ``upgrade`` (upgrade_net_proto_text/binary,
upgrade_solver_proto_text), ``convert-imageset``, ``compute-image-mean``; and ``export`` takes a net out to
StableHLO or Flax.

The log goes to stderr through the ``caffejax`` logger, formatted like Caffe's glog lines. Bad input ends the
command with one line, ``caffejax: error: <what is wrong>``, and exit code 1; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import warnings
from typing import Sequence

from caffejax.errors import CaffejaxError

log = logging.getLogger("caffejax")

PROG = "caffejax"
FORK_LAYERS_HELP = ("enable the layers of popular Caffe forks that caffejax has (caffejax.lower.forks: SSD's "
                    "PriorBox, DetectionOutput, Permute, Normalize; Upsample, Interp, ReLU6)")


class UsageError(Exception):
    """The command line itself is wrong (argparse's complaints)."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage problem as one line and exit code 1, like every other bad input; and reads
    the boolean flags added by :func:`add_gflags_bool` as gflags does."""

    gflags_bools: frozenset[str] = frozenset()

    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} --help')")

    def parse_known_args(self, args=None, namespace=None):
        if args is not None and self.gflags_bools:
            args = _gflags_bool_args(list(args), self.gflags_bools, self.error)
        return super().parse_known_args(args, namespace)


# gflags' spellings of a boolean flag's value (case-insensitive).
GFLAGS_TRUE, GFLAGS_FALSE = ("true", "t", "yes", "y", "1"), ("false", "f", "no", "n", "0")


def add_gflags_bool(parser: _Parser, name: str, help: str) -> None:
    """A boolean flag spelled as gflags reads one: ``-NAME``, ``--NAME``, ``-NAME=true|false`` (or 1/0, yes/no)
    and ``-noNAME``; Caffe's scripts write all of these (``convert_imageset --shuffle=true``)."""
    parser.add_argument(f"-{name}", f"--{name}", dest=name, action="store_true", help=help)
    parser.add_argument(f"-no{name}", f"--no{name}", dest=name, action="store_false", help=argparse.SUPPRESS)
    parser.gflags_bools = parser.gflags_bools | {name}


def _gflags_bool_args(args: list[str], names, error) -> list[str]:
    """``-NAME=VALUE`` of a boolean flag as ``-NAME`` or ``-noNAME`` (argparse takes no value for a switch)."""
    out = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        flag, eq, value = arg.partition("=")
        name = flag.lstrip("-")
        if eq and flag.startswith("-") and len(flag) - len(name) <= 2 and name in names:
            if value.lower() in GFLAGS_TRUE:
                arg = f"-{name}"
            elif value.lower() in GFLAGS_FALSE:
                arg = f"-no{name}"
            else:
                error(f"argument -{name}: illegal value '{value}' specified for bool flag (use true or false)")
        out.append(arg)
    return out


def build_parser() -> argparse.ArgumentParser:
    from caffejax.cli import imagesets, nets

    parser = _Parser(prog=PROG, description="Caffe's command-line tools on caffejax (Caffe nets compiled by XLA).")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    parser.add_argument("--fork-layers", action="store_true", help=FORK_LAYERS_HELP)
    # Sub-commands accept these too; SUPPRESS keeps their default from overriding the top-level flag.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of an error")
    common.add_argument("--fork-layers", action="store_true", default=argparse.SUPPRESS, help=FORK_LAYERS_HELP)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    nets.add_commands(commands, [common])
    imagesets.add_commands(commands, [common])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (0, or 1 for any error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    with _logging_to_stderr():
        try:
            parser = build_parser()
            args = parser.parse_args(argv)
            if getattr(args, "run", None) is None:  # no command given
                parser.print_help(sys.stderr)
                return 1
            if args.fork_layers:
                from caffejax.lower import forks

                forks.register_all()
            return int(args.run(args) or 0)
        except SystemExit as e:  # --help, or argparse's own exits
            if e.code is None or isinstance(e.code, int):
                return e.code or 0
            return 1
        except KeyboardInterrupt:
            print(f"{PROG}: interrupted", file=sys.stderr)
            return 130
        except Exception as e:  # noqa: BLE001 -- every failure becomes one line (or a traceback with --debug)
            if debug:
                raise
            print(f"{PROG}: error: {error_line(e)}", file=sys.stderr)
            return 1


def error_line(error: BaseException) -> str:
    """The error as one line: our messages as they are; anything else named as an internal error."""
    if isinstance(error, (CaffejaxError, UsageError)):
        text = str(error)
    elif isinstance(error, OSError) and error.filename is not None:
        text = f"{error.filename}: {error.strerror or error}"
    else:
        text = f"internal error: {type(error).__name__}: {error} (run with --debug for the traceback)"
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


@contextlib.contextmanager
def _logging_to_stderr():
    """For one command: the caffejax logger on stderr, at INFO unless ``GLOG_minloglevel`` asks for less (as
    Caffe's tool reads it), with Python warnings logged as warnings."""
    from caffejax.runtime.mode import GlogFormatter, glog_level

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(GlogFormatter())
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(glog_level())
    log.propagate = False
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _log_warning
            yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def _log_warning(message, category, filename, lineno, file=None, line=None) -> None:
    log.warning("%s", message)


