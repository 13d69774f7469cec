"""Reading Caffe's text format (prototxt) for nets and solvers.

Parsing goes through protobuf's ``text_format`` against caffejax's own ``caffe.proto``: it builds messages
and nothing else, so an untrusted prototxt can never execute code. Errors carry the file, line and column
and the offending source line.

Fields that only exist in popular Caffe forks are handled in two ways. A fork's spelling of something BVLC
has (``ceil_mode`` for ``round_mode``) is rewritten to the BVLC field before parsing (``FORK_FIELDS``). A
fork's own layer parameters (SSD's ``norm_param``, YOLO's ``upsample_param``...) are declared with
:func:`register_fork_param` by whoever supplies the layer's rule (``caffejax.lower.forks``): the parser then
accepts them, keeps them inside the LayerParameter (as protobuf unknown fields, so they travel with the layer
through upgrades, filtering and caching) and rules read them with :func:`fork_param`. Any other field is a
ParseError naming the file, line and column, with a hint when it looks like a fork's layer parameter.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from typing import Any, Callable, TypeVar

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory, text_encoding, text_format

from caffejax.errors import CaffejaxError, ParseError, SchemaError, at_location
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

# Real prototxts are well under 1 MiB (ResNet-152's deploy file is 0.2 MiB); anything this big is hostile or
# not a prototxt, and protobuf's pure-Python text parser would take minutes over it.
MAX_TEXT_BYTES = 16 * 2 ** 20

# Each fork-field rewrite copies the text and parses it again: a bound on the characters handled that way keeps a
# file full of them from taking hours (a real net rewrites a handful of pooling layers).
_MAX_REWRITE_WORK = 64 * 2 ** 20

# Caffe reads prototxts with protobuf's C++ tokenizer, which refuses a string escape it does not know (most often
# a Windows path, "C:\data\train"). Python's text_format keeps such a sequence as written, with a DeprecationWarning,
# while the path's "\t" silently becomes a tab. So strings are checked against the C++ escapes first: comments and
# strings are found in one left-to-right scan, and each backslash pair inside a string in order.
_STRING_OR_COMMENT = re.compile(r"""#[^\n]*|"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?""")
_BACKSLASH_PAIR = re.compile(r"\\(.?)", re.S)
_C_ESCAPES = frozenset("abfnrtv\\'\"?01234567xXuU")  # truncated \x, \u, \U are text_format's to report

# protobuf's messages look like '12:5 : Message type "caffe.X" has no field named "y".'
_POSITION = re.compile(r"^(\d+):(\d+) : (.*)$", re.S)
_NO_FIELD = re.compile(r'Message type "([\w.]+)" has no field named "(\w+)"')


def read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TEXT_BYTES + 1)
    except OSError as e:
        raise ParseError(f"cannot read file: {e.strerror}", path=path) from None
    if len(raw) > MAX_TEXT_BYTES:
        raise ParseError(f"file is larger than {MAX_TEXT_BYTES >> 20} MiB: not a prototxt caffejax will parse",
                         path=path)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ParseError("file is not UTF-8 text (is it a binary caffemodel?)", path=path, line=line) from None


def parse_text(text: str, msg: M, path: str | None = None) -> M:
    """Parse ``text`` into ``msg`` (a fresh message), rewriting known fork fields; errors name the location.

    Registered fork parameters are parsed through a copy of caffe.proto that declares them, then carried into
    ``msg`` as unknown fields (see the module docstring).
    """
    where = path or "<string>"
    if len(text) > MAX_TEXT_BYTES:
        raise ParseError(f"text is larger than {MAX_TEXT_BYTES >> 20} MiB: not a prototxt caffejax will parse",
                         path=where)
    source = text
    text, question_marks = _with_c_escapes(text, where)
    target = _fork_aware(msg)
    fork_rewrites = reparsed = 0
    while True:
        try:
            text_format.Parse(text, target, allow_unknown_extension=False)
            break
        except text_format.ParseError as e:
            line, column, reason = _split_position(str(e))
            rewritten = _rewrite_fork_field(text, line, column, reason) if line is not None else None
            reparsed += len(text)  # a rewrite copies the text, and the parse starts over
            if rewritten is not None and reparsed > _MAX_REWRITE_WORK:
                reason += f" (caffejax rewrote {fork_rewrites} fork fields and stops there: too many for a net)"
                rewritten = None
            if rewritten is None:
                raise ParseError(reason + _fork_hint(reason), path=where, line=line,
                                 column=_source_column(question_marks, line, column),
                                 text=_source_line(source, line)) from None
            text, fork_rewrites = rewritten, fork_rewrites + 1
            target.Clear()
        except RecursionError:
            raise ParseError("message nesting is too deep", path=where) from None
    if target is not msg:
        msg.MergeFromString(target.SerializeToString())
    return msg


def parse_net_text(source: str, *, is_path: bool | None = None) -> caffe_pb2.NetParameter:
    """A NetParameter from a prototxt path or from prototxt text (``is_path`` decides; guessed if None)."""
    return _parse_source(source, caffe_pb2.NetParameter(), is_path)


def parse_solver_text(source: str, *, is_path: bool | None = None) -> caffe_pb2.SolverParameter:
    return _parse_source(source, caffe_pb2.SolverParameter(), is_path)


def _parse_source(source: str, msg: M, is_path: bool | None) -> M:
    if not isinstance(source, (str, os.PathLike)):
        name = msg.DESCRIPTOR.name
        raise TypeError(f"a {name} comes from a prototxt path, prototxt text (str) or a caffe_pb2.{name}, not a "
                        f"{type(source).__name__}" + (" (decode the bytes first; a binary protobuf is read with "
                                                       "caffejax.frontend.caffemodel.read_binary_net)"
                                                       if isinstance(source, (bytes, bytearray)) else ""))
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


def _with_c_escapes(text: str, where: str) -> tuple[str, dict[int, list[int]]]:
    """``text`` with its strings' escapes checked as Caffe's C++ parser checks them: an unknown one is a
    ParseError at its line and column; ``\\?`` (a question mark in C++, kept as two characters by Python's
    parser) becomes ``?``. Also returns, per line, the columns of the text returned where such a ``?`` now is,
    for :func:`_source_column`."""
    question_marks: dict[int, list[int]] = {}
    if "\\" not in text:
        return text, question_marks
    pieces, copied = [], 0
    line, line_start, counted = 1, 0, 0  # the line at offset ``counted`` and where it starts: one pass in all
    for token in _STRING_OR_COMMENT.finditer(text):
        if token.group().startswith("#") or "\\" not in token.group():
            continue
        for pair in _BACKSLASH_PAIR.finditer(token.group()):
            offset = token.start() + pair.start()
            newlines = text.count("\n", counted, offset)
            if newlines:
                line, line_start = line + newlines, text.rfind("\n", counted, offset) + 1
            counted, column = offset, offset - line_start + 1
            if pair.group(1) == "?":
                pieces += [text[copied:offset], "?"]
                copied = offset + 2
                earlier = question_marks.setdefault(line, [])
                earlier.append(column - len(earlier))  # each earlier one on the line took a character out
            elif pair.group(1) not in _C_ESCAPES:
                raise ParseError(f"Invalid escape sequence in string literal: '{pair.group()}'. Caffe refuses it; "
                                 "in a path, write / (or \\\\) for each \\", path=where, line=line, column=column,
                                 text=_source_line(text, line))
    return "".join(pieces) + text[copied:], question_marks


def _source_column(question_marks: dict[int, list[int]], line: int | None, column: int | None) -> int | None:
    """A column of the parsed text as a column of the source: one more for each ``\\?`` before it."""
    if line is None or column is None:
        return column
    return column + sum(1 for mark in question_marks.get(line, ()) if mark < column)


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
    # The line breaks of "field:\n value" are kept, so later errors still name the source's lines.
    return text[:offset] + replacement + "\n" * text.count("\n", offset, fm.end()) + text[fm.end():]


# ---- layer parameters of Caffe forks ------------------------------------------------------------------------

# protobuf's scalar types, as a fork's caffe.proto spells them.
_SCALAR_TYPES = {
    "double": descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE,
    "float": descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT,
    "int64": descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
    "uint64": descriptor_pb2.FieldDescriptorProto.TYPE_UINT64,
    "int32": descriptor_pb2.FieldDescriptorProto.TYPE_INT32,
    "uint32": descriptor_pb2.FieldDescriptorProto.TYPE_UINT32,
    "bool": descriptor_pb2.FieldDescriptorProto.TYPE_BOOL,
    "string": descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
}
_MAX_FIELD_NUMBER = 2 ** 29 - 1
_RESERVED_NUMBERS = range(19000, 20000)  # protobuf's own


@dataclasses.dataclass(frozen=True)
class ForkParamField:
    """One field of a fork's parameter message, as its caffe.proto declares it.

    ``type`` is a protobuf scalar type (``"int32"``, ``"float"``, ``"bool"``, ``"string"``...), the name of
    one of caffe.proto's messages (``"FillerParameter"``), or of one of the fork's own messages or enums
    (:class:`ForkMessage`, :class:`ForkEnum`). ``default`` is the ``[default = ...]`` value (an enum's value by
    name).
    """

    name: str
    type: str
    number: int
    default: Any = None
    repeated: bool = False


@dataclasses.dataclass(frozen=True)
class ForkParam:
    """A parameter message a Caffe fork added to LayerParameter, e.g. SSD's
    ``optional NormalizeParameter norm_param = 206``: ``field`` "norm_param", ``message``
    "NormalizeParameter", ``number`` 206 and the message's ``fields``. ``origin`` names the fork for messages.

    ``number`` only matters on the wire (caffemodels caffejax writes carry it); it must not collide with a BVLC
    field, so a fork number that does (DeepLab's interp_param = 143 is BVLC's input_param) is replaced by a
    free one.
    """

    field: str
    message: str
    number: int
    fields: tuple[ForkParamField, ...]
    origin: str = ""
    messages: tuple["ForkMessage", ...] = ()  # further messages its fields use (SSD's nms_param)
    enums: tuple["ForkEnum", ...] = ()  # enums nested in ``message``


@dataclasses.dataclass(frozen=True)
class ForkMessage:
    """A further message a fork declares for its parameter's fields, e.g. SSD's NonMaximumSuppressionParameter,
    with the enums nested in it."""

    name: str
    fields: tuple[ForkParamField, ...]
    enums: tuple["ForkEnum", ...] = ()


@dataclasses.dataclass(frozen=True)
class ForkEnum:
    """An enum nested in a fork's parameter message: its values as (name, number), e.g. SSD's
    ``CodeType { CORNER = 1; CENTER_SIZE = 2; CORNER_SIZE = 3; }``."""

    name: str
    values: tuple[tuple[str, int], ...]


_FORK_PARAMS: dict[str, ForkParam] = {}  # part of the layer registry: field name -> its declaration


def register_fork_param(fork: ForkParam) -> ForkParam:
    """Let prototxts use ``fork.field`` in a layer; rules read it with :func:`fork_param`.

    Registering the same declaration twice is a no-op; a different declaration under a registered name, a
    BVLC field name or number, or an unknown field type is a SchemaError.
    """
    registered = _FORK_PARAMS.get(fork.field)
    if registered == fork:
        return fork
    if registered is not None:
        raise SchemaError(f"fork field '{fork.field}' is already registered with another declaration "
                          f"({registered.message} from {registered.origin or 'an earlier registration'})")
    _check_fork_param(fork)
    _FORK_PARAMS[fork.field] = fork
    return fork


def registered_fork_params() -> tuple[ForkParam, ...]:
    return tuple(_FORK_PARAMS[name] for name in sorted(_FORK_PARAMS))


def fork_param(layer_param: caffe_pb2.LayerParameter, field: str):
    """The fork parameter message ``field`` of a layer: what its prototxt said, defaults elsewhere."""
    if field not in _FORK_PARAMS:
        raise SchemaError(f"fork field '{field}' is not registered (register_fork_param)")
    extended = _extended_class(caffe_pb2.LayerParameter.DESCRIPTOR.full_name, registered_fork_params())
    return getattr(extended.FromString(layer_param.SerializeToString()), field)


def _check_fork_param(fork: ForkParam) -> None:
    layer = caffe_pb2.LayerParameter.DESCRIPTOR
    taken_numbers = {f.number: f.name for f in layer.fields}
    taken_numbers.update({f.number: f.field for f in _FORK_PARAMS.values()})
    problems = []
    if not re.fullmatch(r"[A-Za-z_]\w*", fork.field) or fork.field in layer.fields_by_name:
        problems.append(f"'{fork.field}' is not a new LayerParameter field name")
    if fork.number in taken_numbers:
        problems.append(f"number {fork.number} is LayerParameter's '{taken_numbers[fork.number]}'")
    if not 0 < fork.number <= _MAX_FIELD_NUMBER or fork.number in _RESERVED_NUMBERS:
        problems.append(f"number {fork.number} is not a usable protobuf field number")
    messages = set(caffe_pb2.DESCRIPTOR.message_types_by_name)
    for other in _FORK_PARAMS.values():
        messages.update([other.message, *(m.name for m in other.messages)])
    own = [fork.message, *(m.name for m in fork.messages)]
    for name in own:
        if not re.fullmatch(r"[A-Za-z_]\w*", name) or name in messages or own.count(name) > 1:
            problems.append(f"message name '{name}' is taken or invalid")
    extra_names = set(own[1:])
    for fields, enum_list in ((fork.fields, fork.enums), *((m.fields, m.enums) for m in fork.messages)):
        enums = {e.name: e for e in enum_list}
        for e in enum_list:
            value_names = [v for v, _ in e.values]
            if (not re.fullmatch(r"[A-Za-z_]\w*", e.name) or not e.values
                    or len(set(value_names)) < len(value_names) or len({n for _, n in e.values}) < len(e.values)):
                problems.append(f"enum '{e.name}' needs a valid name and distinct value names and numbers")
        types = set(_SCALAR_TYPES) | set(caffe_pb2.DESCRIPTOR.message_types_by_name) | extra_names | set(enums)
        names, numbers = set(), set()
        for f in fields:
            if f.name in names or f.number in numbers or not 0 < f.number <= _MAX_FIELD_NUMBER:
                problems.append(f"field '{f.name}' = {f.number} repeats a name or number, or the number is invalid")
            names.add(f.name)
            numbers.add(f.number)
            if f.type not in types:
                problems.append(f"field '{f.name}' has unknown type '{f.type}'")
            elif f.default is not None and (f.repeated or f.type not in _SCALAR_TYPES and f.type not in enums):
                problems.append(f"field '{f.name}' cannot have a default (repeated or message-typed)")
            elif f.type in enums and f.default is not None and f.default not in dict(enums[f.type].values):
                problems.append(f"field '{f.name}': default {f.default!r} is not a value of enum '{f.type}'")
    if problems:
        raise SchemaError(f"cannot register fork field '{fork.field}' ({fork.message}): " + "; ".join(problems))


def _field_proto(f: ForkParamField, enums: dict[str, str] | None = None) -> descriptor_pb2.FieldDescriptorProto:
    """``f`` as a descriptor; ``enums``: the enums its message may use, name -> full name."""
    proto = descriptor_pb2.FieldDescriptorProto(
        name=f.name, number=f.number,
        label=(descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED if f.repeated
               else descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL))
    if f.type in _SCALAR_TYPES:
        proto.type = _SCALAR_TYPES[f.type]
        if f.default is not None:
            proto.default_value = (str(f.default).lower() if isinstance(f.default, bool) else
                                   repr(float(f.default)) if f.type in ("float", "double") else str(f.default))
    elif enums and f.type in enums:
        proto.type = descriptor_pb2.FieldDescriptorProto.TYPE_ENUM
        proto.type_name = enums[f.type]
        if f.default is not None:
            proto.default_value = f.default
    else:
        proto.type = descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE
        proto.type_name = f".caffe.{f.type}"
    return proto


@functools.lru_cache(maxsize=8)
def _extended_pool(forks: tuple[ForkParam, ...]) -> descriptor_pool.DescriptorPool:
    """A private copy of caffe.proto whose LayerParameter also declares ``forks``."""
    file = descriptor_pb2.FileDescriptorProto.FromString(caffe_pb2.DESCRIPTOR.serialized_pb)
    layer = next(m for m in file.message_type if m.name == "LayerParameter")
    for fork in forks:
        declared = [(m.name, m.fields, m.enums) for m in fork.messages] + [(fork.message, fork.fields, fork.enums)]
        for name, fields, enum_list in declared:
            enums = {e.name: f".caffe.{name}.{e.name}" for e in enum_list}
            message = file.message_type.add(name=name, field=[_field_proto(f, enums) for f in fields])
            for e in enum_list:
                message.enum_type.add(name=e.name, value=[descriptor_pb2.EnumValueDescriptorProto(name=n, number=i)
                                                          for n, i in e.values])
        layer.field.add(name=fork.field, number=fork.number,
                        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
                        type=descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE, type_name=f".caffe.{fork.message}")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return pool


def _extended_class(full_name: str, forks: tuple[ForkParam, ...]):
    return message_factory.GetMessageClass(_extended_pool(forks).FindMessageTypeByName(full_name))


def _fork_aware(msg: M):
    """The message to parse into: ``msg`` itself, or (with fork fields registered) a fresh instance of the same
    message from the extended caffe.proto."""
    cls = fork_aware_class(type(msg))
    return msg if cls is type(msg) else cls()


def fork_aware_class(message_class):
    """One of caffe.proto's message classes, from the extended caffe.proto when fork fields are registered: its
    instances then have those fields (a NetSpec's LayerParameter gets ``prior_box_param``), and print them."""
    forks = registered_fork_params()
    if not forks or message_class.DESCRIPTOR.file is not caffe_pb2.DESCRIPTOR:
        return message_class
    return _extended_class(message_class.DESCRIPTOR.full_name, forks)


def fork_message_class(name: str):
    """A message a registered fork declares (``"PriorBoxParameter"``), or None."""
    forks = registered_fork_params()
    if not any(name in (fork.message, *(m.name for m in fork.messages)) for fork in forks):
        return None
    return _extended_class(f"caffe.{name}", forks)


def as_bvlc_message(msg, message_class):
    """``msg`` as an instance of ``message_class`` (one of caffe.proto's): itself, or the same message of the
    extended caffe.proto (fork_aware_class) converted, its fork fields kept as unknown fields on the wire."""
    if isinstance(msg, message_class) or getattr(msg, "DESCRIPTOR", None) is None \
            or msg.DESCRIPTOR.full_name != message_class.DESCRIPTOR.full_name:
        return msg
    return message_class.FromString(msg.SerializeToString())


def to_text(msg) -> str:
    """``msg`` as prototxt text as Caffe's C++ writes it (TextFormat: its logged parameters, the files
    upgrade_net_proto_text writes), with its registered fork fields (``text_format.MessageToString`` of a BVLC
    message drops them: there they are unknown fields, kept only on the wire). Floats print as C++'s SimpleFtoa
    prints them, ``lr_mult: 1`` and ``scale: 0.00390625``, where Python's protobuf writes ``lr_mult: 1.0``."""
    target = _fork_aware(type(msg)())
    if type(target) is not type(msg):
        target.ParseFromString(msg.SerializeToString())
        msg = target
    return "".join(_text_lines(msg, ""))


def _text_lines(msg, indent: str):
    """TextFormat::Printer's lines: set fields in field-number order, a message as ``name {`` ... ``}``."""
    for field, value in msg.ListFields():
        for item in value if field.is_repeated else (value,):
            if field.cpp_type == field.CPPTYPE_MESSAGE:
                yield f"{indent}{field.name} {{\n"
                yield from _text_lines(item, indent + "  ")
                yield f"{indent}}}\n"
            else:
                yield f"{indent}{field.name}: {_text_scalar(field, item)}\n"


def _text_scalar(field, value) -> str:
    if field.cpp_type == field.CPPTYPE_ENUM:
        known = field.enum_type.values_by_number.get(value)
        return known.name if known is not None else str(value)
    if field.cpp_type == field.CPPTYPE_STRING:
        data = value if isinstance(value, bytes) else value.encode("utf-8")
        return '"' + text_encoding.CEscape(data, as_utf8=False) + '"'
    if field.cpp_type == field.CPPTYPE_BOOL:
        return "true" if value else "false"
    if field.cpp_type == field.CPPTYPE_FLOAT:
        return _shortest_decimal(value, 6, lambda text: np.float32(text) == np.float32(value))
    if field.cpp_type == field.CPPTYPE_DOUBLE:
        return _shortest_decimal(value, 15, lambda text: float(text) == value)
    return str(value)


def _shortest_decimal(value: float, digits: int, round_trips) -> str:
    """C++ protobuf's SimpleFtoa (6 significant digits, else 9) and SimpleDtoa (15, else 17)."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    text = f"{value:.{digits}g}"
    return text if round_trips(text) else f"{value:.{digits + (3 if digits == 6 else 2)}g}"


def _fork_hint(reason: str) -> str:
    """For a LayerParameter field BVLC lacks: which fork it likely comes from and how to accept it."""
    m = _NO_FIELD.search(reason)
    if not m or m.group(1) != "caffe.LayerParameter":
        return ""
    field = m.group(2)
    from caffejax.lower import forks  # the catalogue of fork layers caffejax ships (lazy: lower imports us)

    provider = forks.provider_of(field)
    if provider is not None:
        return " " + forks.enabling_hint(provider)
    if field.endswith("_param"):
        return (" BVLC's caffe.proto has no such layer parameter; if it comes from a Caffe fork, declare it with "
                "caffejax.frontend.prototxt.register_fork_param and register the layer's rule with "
                "caffejax.register_layer.")
    return ""


# ---- where a layer is defined (for messages) ---------------------------------------------------------------------

_TOKEN = re.compile(r"""(?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')|(?P<comment>\#[^\n]*)"""
                    r"|(?P<open>[{<])|(?P<close>[}>])|(?P<word>[A-Za-z_][\w.]*)|(?P<newline>\n)")


def layer_lines(text: str) -> list[tuple[int, str]]:
    """(line, name) of every top-level ``layer``/``layers`` block of a net prototxt, in order."""
    found: list[tuple[int, str]] = []
    depth, line, last_word, pending_layer = 0, 1, None, None
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup
        if kind == "newline":
            line += 1
        elif kind == "word":
            last_word = m.group()
            if depth == 0 and last_word in ("layer", "layers"):
                pending_layer = line
        elif kind == "open":
            if depth == 0 and pending_layer is not None:
                found.append((pending_layer, ""))
            pending_layer = None
            depth += 1
        elif kind == "close":
            depth = max(depth - 1, 0)
        elif kind == "string" and depth == 1 and last_word == "name" and found and not found[-1][1]:
            found[-1] = (found[-1][0], text_format.Tokenizer([m.group()]).ConsumeString())
            last_word = None
    return found


def locate_layer_error(error: CaffejaxError, source) -> CaffejaxError:
    """``error`` with ``file:line`` of its layer's definition in front, where the layer is found in ``source``
    (a prototxt path or text; anything else, e.g. a NetParameter, leaves the error as it is)."""
    if getattr(error, "layer", None) is None or getattr(error, "located", False):
        return error
    if isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source
                                           and os.path.isfile(source)):
        path = os.fspath(source)
        try:
            text = read_text(path)
        except ParseError:
            return error
    elif isinstance(source, str):
        path, text = "<string>", source
    else:
        return error
    found = layer_lines(text)
    lines = [line for line, name in found if name == error.layer]
    renamed = re.fullmatch(r"(.*)#(\d+)", error.layer)
    if not lines and renamed:  # build.distinct_layer_names's name#k: the k-th layer named name
        lines = [line for line, name in found if name == renamed.group(1)][int(renamed.group(2)) - 1:]
    return at_location(error, f"{path}:{lines[0]}") if lines else error


def top_level_fields(text: str) -> dict[str, int]:
    """field name -> line of its first occurrence at the top level of a prototxt (e.g. a solver's fields)."""
    lines: dict[str, int] = {}
    depth, line = 0, 1
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup
        if kind == "newline":
            line += 1
        elif kind == "open":
            depth += 1
        elif kind == "close":
            depth = max(depth - 1, 0)
        elif kind == "word" and depth == 0:
            lines.setdefault(m.group(), line)
    return lines


def locate_solver_error(error: CaffejaxError, path: str | None) -> CaffejaxError:
    """A solver check's error with ``file:line`` in front: the line of the first solver field the message
    names (``iter_size should be at least 1`` -> the ``iter_size:`` line), else just the file."""
    if path is None or error.located:
        return error
    try:
        fields = top_level_fields(read_text(path))
    except ParseError:
        return error
    message = str(error).lower()
    mentions = [(m.start(), line) for name, line in fields.items() for spelling in {name, name.replace("_", " ")}
                for m in [re.search(rf"\b{re.escape(spelling.lower())}\b", message)] if m]
    return at_location(error, f"{path}:{min(mentions)[1]}" if mentions else path)
