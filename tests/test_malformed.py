"""Hostile and broken input: every fixture of tests/fixtures/malformed is refused with the CaffejaxError its
EXPECTATIONS.json entry names, with a message holding the file (and line), the layer, blobs and shapes; the
command line reports the same problem as one line and exit status 1; and a Python layer in a model file never
imports anything unless the user allows it."""

from __future__ import annotations

import json
import os
import sys

import pytest

import caffejax
from caffejax.cli import main as cli_main
from conftest import FIXTURES

MALFORMED = FIXTURES / "malformed"
EXPECTATIONS = json.loads((MALFORMED / "EXPECTATIONS.json").read_text())
CASES = sorted(name for name in EXPECTATIONS if not name.startswith("_"))
HELPERS = {"EXPECTATIONS.json", "regenerate.py"}
VALID_NET, VALID_SOLVER = str(MALFORMED / "valid_net.prototxt"), str(MALFORMED / "valid_solver.prototxt")


def _load(how: str, path: str) -> None:
    if how == "net":
        caffejax.Net(path, caffejax.TEST)
    elif how == "weights":
        caffejax.Net(VALID_NET, caffejax.TEST, weights=path)
    elif how == "solver":
        caffejax.get_solver(path)
    elif how == "state":
        caffejax.get_solver(VALID_SOLVER).restore(path)
    else:
        raise AssertionError(f"unknown load kind {how!r}")


def _command(how: str, path: str) -> list[str]:
    return {"net": ["time", "-model", path, "-phase", "TEST", "-iterations", "1"],
            "weights": ["test", "-model", VALID_NET, "-weights", path, "-iterations", "1"],
            "solver": ["train", "-solver", path],
            "state": ["train", "-solver", VALID_SOLVER, "-snapshot", path]}[how]


def test_the_corpus_is_complete():
    files = {p.name for p in MALFORMED.iterdir() if p.is_file()}
    helpers = HELPERS | {name for name in files if name.startswith("valid_")}
    assert files - helpers == set(CASES), "every malformed fixture needs an entry in EXPECTATIONS.json"
    assert len(CASES) >= 40
    # The valid artefacts the others are broken copies of load fine.
    caffejax.Net(VALID_NET, caffejax.TEST, weights=str(MALFORMED / "valid_net.caffemodel"))
    caffejax.get_solver(VALID_SOLVER)


@pytest.mark.parametrize("name", CASES)
def test_refused_with_a_clear_error(name):
    expected = EXPECTATIONS[name]
    with pytest.raises(caffejax.CaffejaxError) as info:
        _load(expected["load"], str(MALFORMED / name))
    message = str(info.value)
    assert type(info.value).__name__ == expected["error"], message
    for part in expected["contains"]:
        assert part in message, f"{part!r} missing from: {message}"


@pytest.mark.parametrize("name", CASES)
def test_command_line_prints_one_line_and_fails(name, capsys):
    expected = EXPECTATIONS[name]
    assert cli_main(_command(expected["load"], str(MALFORMED / name))) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("caffejax: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    for part in expected["contains"]:
        assert part in errors[0], f"{part!r} missing from: {errors[0]}"


# ---- no code execution from model files ----------------------------------------------------------------------

PAYLOAD = "caffejax_malformed_payload"  # the module python_layer.prototxt names


@pytest.fixture
def payload_module(tmp_path, monkeypatch):
    """A module on sys.path that, if ever imported, writes a file: proof that model code ran."""
    marker = tmp_path / "payload_ran.txt"
    (tmp_path / f"{PAYLOAD}.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text('the model ran code')\n"
        "import caffejax\n\n"
        "class Payload(caffejax.Layer):\n"
        "    def reshape(self, bottom, top):\n"
        "        top[0].reshape(*bottom[0].data.shape)\n\n"
        "    def forward(self, bottom, top):\n"
        "        top[0].data[...] = 2 * bottom[0].data\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, PAYLOAD, raising=False)
    return marker


def test_python_layer_is_never_imported_unless_allowed(payload_module, tmp_path, capsys):
    fixture = str(MALFORMED / "python_layer.prototxt")
    before = sorted(os.listdir(tmp_path))
    for phase in (caffejax.TRAIN, caffejax.TEST):
        with pytest.raises(caffejax.UnsupportedError, match=PAYLOAD):
            caffejax.Net(fixture, phase)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{fixture}" base_lr: 0.1 lr_policy: "fixed"\n')
    with pytest.raises(caffejax.UnsupportedError, match=PAYLOAD):
        caffejax.get_solver(str(solver))
    before.append("solver.prototxt")
    # Every command that reads the net leaves the module alone too.
    assert cli_main(["time", "-model", fixture, "-iterations", "1"]) == 1
    assert cli_main(["draw", fixture, str(tmp_path / "net.dot")]) == 0
    assert cli_main(["upgrade", fixture, str(tmp_path / "upgraded.prototxt")]) == 0
    before += ["net.dot", "upgraded.prototxt"]
    assert PAYLOAD not in sys.modules
    assert not payload_module.exists()
    assert sorted(os.listdir(tmp_path)) == sorted(before)

    # The control: when the user allows it, the same module is imported and runs.
    net = caffejax.Net(fixture, caffejax.TEST, allow_python_layers=True)
    assert PAYLOAD in sys.modules and payload_module.exists()
    net.blobs["data"].data[...] = 1.5
    assert (net.forward()["out"] == 3.0).all()


# ---- payloads too big to keep as fixtures ----------------------------------------------------------------------

def test_gigantic_and_deeply_nested_payloads_are_refused_or_harmless(tmp_path):
    from caffejax.frontend.caffemodel import _encode_len_field, _encode_varint, read_weights
    from caffejax.frontend.prototxt import MAX_TEXT_BYTES
    from caffejax.proto import caffe_pb2

    huge = tmp_path / "huge.prototxt"
    layer = 'layer { name: "relu" type: "ReLU" bottom: "x" top: "x" }\n'
    huge.write_text(layer * (MAX_TEXT_BYTES // len(layer) + 1))
    with pytest.raises(caffejax.ParseError, match="huge.prototxt: file is larger than 16 MiB"):
        caffejax.Net(str(huge), caffejax.TEST)
    with pytest.raises(caffejax.ParseError, match="<string>:1:9: .* no field named \"layer\""):
        caffejax.Net("layer { " * 50_000 + "}" * 50_000, caffejax.TEST)

    # A caffemodel field claiming 2^62 bytes is refused before anything of that size is made.
    giant = tmp_path / "giant.caffemodel"
    giant.write_bytes(_encode_varint((100 << 3) | 2) + _encode_varint(2 ** 62) + b"xx")
    with pytest.raises(caffejax.WeightsError, match="runs past the end"):
        read_weights(str(giant))
    # caffe.proto has no recursive message, so deep nesting can only hide in unknown fields, which protobuf keeps
    # as bytes without descending into them: a layer carrying 5000 nested levels loads at once, unharmed.
    nested = b""
    for _ in range(5000):
        nested = _encode_len_field(9999, nested)
    deep = tmp_path / "deep.caffemodel"
    deep.write_bytes(_encode_len_field(100, caffe_pb2.LayerParameter(name="conv1").SerializeToString() + nested))
    assert read_weights(str(deep)).blobs == {"conv1": []}
