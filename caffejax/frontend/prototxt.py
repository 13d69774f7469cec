"""Reading Caffe's text format (prototxt) for nets and solvers.

Parsing goes through protobuf's ``text_format`` against caffejax's own ``caffe.proto``: it builds messages
and nothing else, so an untrusted prototxt can never execute code. Errors carry the file, line and column
and the offending source line.

Fields that only exist in popular Caffe forks are reported, except where their meaning in BVLC terms is
unambiguous; those are rewritten to the BVLC field before parsing (see ``FORK_FIELDS``).
"""

from __future__ import annotations

import os
import re
from typing import Callable, TypeVar

from google.protobuf import message, text_format

from caffejax.errors import ParseError
from caffejax.proto import caffe_pb2

M = TypeVar("M", bound=message.Message)

# A fork's bool field is read the way text_format reads a bool (its ParseBool spellings).
_BOOL_SPELLINGS = {"true": True, "t": True, "1": True, "True": True,
                   "false": False, "f": False, "0": False, "False": False}

# (message full name, fork field) -> rewrite of "field: value" into BVLC text, or None if ambiguous.
# `ceil_mode` comes from forks (e.g. the DenseNet / ResNeXt ports) that predate BVLC's `round_mode`.
FORK_FIELDS: dict[tuple[str, str], Callable[[str], str | None]] = {
    ("caffe.PoolingParameter", "ceil_mode"): lambda value: {
        True: "round_mode: CEIL", False: "round_mode: FLOOR"}.get(_BOOL_SPELLINGS.get(value)),
}

# protobuf's messages look like '12:5 : Message type "caffe.X" has no field named "y".'
_POSITION = re.compile(r"^(\d+):(\d+) : (.*)$", re.S)
_NO_FIELD = re.compile(r'Message type "([\w.]+)" has no field named "(\w+)"')


def read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ParseError(f"cannot read file: {e.strerror}", path=path) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ParseError("file is not UTF-8 text (is it a binary caffemodel?)", path=path, line=line) from None


def parse_text(text: str, msg: M, path: str | None = None) -> M:
    """Parse ``text`` into ``msg`` (a fresh message), rewriting known fork fields; errors name the location."""
    fork_rewrites = 0
    while True:
        try:
            text_format.Parse(text, msg, allow_unknown_extension=False)
            return msg
        except text_format.ParseError as e:
            line, column, reason = _split_position(str(e))
            rewritten = _rewrite_fork_field(text, line, column, reason) if line is not None else None
            if rewritten is None or fork_rewrites > 10_000:
                raise ParseError(reason, path=path or "<string>", line=line, column=column,
                                 text=_source_line(text, line)) from None
            text, fork_rewrites = rewritten, fork_rewrites + 1
            msg.Clear()
        except RecursionError:
            raise ParseError("message nesting is too deep", path=path or "<string>") from None


def parse_net_text(source: str, *, is_path: bool | None = None) -> caffe_pb2.NetParameter:
    """A NetParameter from a prototxt path or from prototxt text (``is_path`` decides; guessed if None)."""
    return _parse_source(source, caffe_pb2.NetParameter(), is_path)


def parse_solver_text(source: str, *, is_path: bool | None = None) -> caffe_pb2.SolverParameter:
    return _parse_source(source, caffe_pb2.SolverParameter(), is_path)


def _parse_source(source: str, msg: M, is_path: bool | None) -> M:
    if is_path is None:
        is_path = isinstance(source, os.PathLike) or ("\n" not in source and "{" not in source
                                                       and ":" not in source.split(os.sep)[-1])
    if is_path:
        path = os.fspath(source)
        return parse_text(read_text(path), msg, path=path)
    return parse_text(source, msg)


def _split_position(error: str) -> tuple[int | None, int | None, str]:
    m = _POSITION.match(error)
    if not m:
        return None, None, error
    return int(m.group(1)), int(m.group(2)), m.group(3)


def _source_line(text: str, line: int | None) -> str | None:
    if line is None:
        return None
    lines = text.splitlines()
    return lines[line - 1].strip()[:200] if 0 < line <= len(lines) else None


def _rewrite_fork_field(text: str, line: int, column: int, reason: str) -> str | None:
    """Rewrite the fork field the error points at into its BVLC equivalent, or None if that is not possible."""
    m = _NO_FIELD.search(reason)
    if not m or (m.group(1), m.group(2)) not in FORK_FIELDS:
        return None
    rewrite = FORK_FIELDS[(m.group(1), m.group(2))]
    lines = text.split("\n")
    src = lines[line - 1]
    start = column - 1
    # protobuf reports the column of the field name (or, on some versions, of the token after it).
    found = src.rfind(m.group(2), 0, start + len(m.group(2)))
    if found < 0:
        return None
    # The value may follow on a later line ("ceil_mode:\n  false"), as text format allows.
    offset = sum(len(previous) + 1 for previous in lines[: line - 1]) + found
    fm = re.compile(re.escape(m.group(2)) + r"\s*:\s*(\w+)").match(text, offset)
    if not fm:
        return None
    replacement = rewrite(fm.group(1))
    if replacement is None:
        return None
    return text[:offset] + replacement + text[fm.end():]
