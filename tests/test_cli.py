"""The caffejax command line: Caffe's tools (train, test, time, upgrade, convert_imageset, compute_image_mean,
extract_features, draw) and export, called in-process through ``main(argv)``."""

from __future__ import annotations

import datetime
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from google.protobuf import text_format

import caffejax
from caffejax import layers as L
from caffejax.cli import main
from caffejax.frontend.caffemodel import read_binary_net, read_blobproto, blobproto_to_array
from caffejax.frontend.prototxt import parse_net_text, parse_solver_text
from caffejax.proto import caffe_pb2
from conftest import BUNDLED

LENET = BUNDLED / "lenet" / "lenet.prototxt"
LENET_WEIGHTS = BUNDLED / "lenet" / "lenet_iter_10000.caffemodel"
COMMANDS = ["train", "test", "time", "device-query", "draw", "upgrade", "export", "convert-imageset",
            "compute-image-mean", "extract-features"]


def run(argv, capsys) -> tuple[int, str]:
    """Exit status and stderr (the log and any error) of one command."""
    status = main([str(a) for a in argv])
    return status, capsys.readouterr().err


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("caffejax: error:")]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        from caffejax.cli import build_parser

        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: caffejax {command}" in capsys.readouterr().out
    assert main([command, "--help"]) == 0


def test_usage_errors_are_one_line(capsys):
    status, err = run(["test", "-model", str(LENET)], capsys)  # -weights is required
    assert status == 1 and error_lines(err) == [err.strip()]
    assert "-weights" in err
    status, err = run(["frobnicate"], capsys)
    assert status == 1 and "invalid choice" in err and "Traceback" not in err
    assert main([]) == 1  # no command: the overview, and a failure status


# ---- upgrade ------------------------------------------------------------------------------------------------

V1_NET = """
name: "V1Net"
input: "data"
input_dim: 1 input_dim: 1 input_dim: 4 input_dim: 4
layers {
  name: "conv" type: CONVOLUTION bottom: "data" top: "conv"
  blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0
  convolution_param { num_output: 2 kernel_size: 3 }
}
layers { name: "relu" type: RELU bottom: "conv" top: "conv" }
"""


def test_upgrade_v1_prototxt(tmp_path, capsys):
    (tmp_path / "v1.prototxt").write_text(V1_NET)
    status, err = run(["upgrade", tmp_path / "v1.prototxt", tmp_path / "v2.prototxt"], capsys)
    assert status == 0, err
    net = parse_net_text(str(tmp_path / "v2.prototxt"), is_path=True)
    assert len(net.layers) == 0 and len(net.input) == 0
    assert [(l.name, l.type) for l in net.layer] == [("input", "Input"), ("conv", "Convolution"), ("relu", "ReLU")]
    assert list(net.layer[0].input_param.shape[0].dim) == [1, 1, 4, 4]
    assert [(p.lr_mult, p.decay_mult) for p in net.layer[1].param] == [(1, 1), (2, 0)]
    caffejax.Net(str(tmp_path / "v2.prototxt"), caffejax.TEST)  # the result builds


def test_upgrade_v1_caffemodel_keeps_blobs(tmp_path, capsys):
    net = text_format.Parse(V1_NET, caffe_pb2.NetParameter())
    weights = np.arange(18, dtype=np.float32).reshape(2, 1, 3, 3)
    bias = np.array([0.5, -1.0], np.float32)
    conv = net.layers[0]
    conv.blobs.add(num=2, channels=1, height=3, width=3).data.extend(weights.ravel().tolist())
    conv.blobs.add(num=1, channels=1, height=1, width=2).data.extend(bias.tolist())
    (tmp_path / "v1.caffemodel").write_bytes(net.SerializeToString())
    status, err = run(["upgrade", tmp_path / "v1.caffemodel", tmp_path / "v2.caffemodel"], capsys)
    assert status == 0, err
    upgraded = read_binary_net(str(tmp_path / "v2.caffemodel"))
    assert len(upgraded.layers) == 0 and [l.type for l in upgraded.layer] == ["Input", "Convolution", "ReLU"]
    np.testing.assert_array_equal(blobproto_to_array(upgraded.layer[1].blobs[0]), weights)
    (tmp_path / "v2.prototxt").write_text(text_format.MessageToString(upgraded))
    loaded = caffejax.Net(str(tmp_path / "v2.prototxt"), str(tmp_path / "v2.caffemodel"), caffejax.TEST)
    np.testing.assert_array_equal(loaded.params["conv"][1].data, bias)


def test_upgrade_solver(tmp_path, capsys):
    (tmp_path / "solver.prototxt").write_text('net: "n.prototxt"\nbase_lr: 0.01\nsolver_type: ADAM\n')
    status, err = run(["upgrade", tmp_path / "solver.prototxt", tmp_path / "new.prototxt"], capsys)
    assert status == 0, err
    solver = parse_solver_text(str(tmp_path / "new.prototxt"), is_path=True)
    assert solver.type == "Adam" and not solver.HasField("solver_type") and solver.net == "n.prototxt"


def test_upgrade_bad_input(tmp_path, capsys):
    (tmp_path / "bad.prototxt").write_text('layer {\n  name: "x"\n  typo: "ReLU"\n}\n')
    status, err = run(["upgrade", tmp_path / "bad.prototxt", tmp_path / "out"], capsys)
    assert status == 1 and error_lines(err) == [err.strip()] and "bad.prototxt:3" in err
    status, err = run(["upgrade", tmp_path / "missing.prototxt", tmp_path / "out"], capsys)
    assert status == 1 and "missing.prototxt" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


# ---- convert-imageset, compute-image-mean -------------------------------------------------------------------

@pytest.fixture
def images(tmp_path):
    """Three small RGB PNGs listed with labels, plus a listed file that does not exist."""
    Image = pytest.importorskip("PIL.Image")
    pytest.importorskip("lmdb")
    rng = np.random.default_rng(0)
    pixels = {}
    for i in range(3):
        name = f"img {i}.png"  # a space in the name: list lines split at their last space
        pixels[name] = rng.integers(0, 256, (5, 4, 3), dtype=np.uint8)
        Image.fromarray(pixels[name]).save(tmp_path / name)
    (tmp_path / "list.txt").write_text("".join(f"{name} {i}\n" for i, name in enumerate(pixels)) + "gone.png 9\n")
    return tmp_path, pixels


def read_lmdb(path) -> list[tuple[str, bytes]]:
    import lmdb

    env = lmdb.open(str(path), readonly=True, lock=False)
    with env.begin() as txn:
        records = [(key.decode(), bytes(value)) for key, value in txn.cursor()]
    env.close()
    return records


def test_convert_imageset_raw(images, capsys):
    from caffejax.data.data_layer import datum_image

    root, pixels = images
    status, err = run(["convert-imageset", f"{root}/", root / "list.txt", root / "db"], capsys)
    assert status == 0, err
    assert "gone.png" in err  # an unreadable image is logged and skipped, as Caffe does
    records = read_lmdb(root / "db")
    assert [key for key, _ in records] == [f"{i:08d}_img {i}.png" for i in range(3)]
    for i, (key, value) in enumerate(records):
        datum = caffe_pb2.Datum.FromString(value)
        assert not datum.encoded and (datum.channels, datum.height, datum.width) == (3, 5, 4)
        image, label = datum_image(value, "color", key)
        np.testing.assert_array_equal(image, pixels[f"img {i}.png"][:, :, ::-1].transpose(2, 0, 1))  # BGR, CHW
        assert label == i
    status, err = run(["convert-imageset", f"{root}/", root / "list.txt", root / "db"], capsys)
    assert status == 1 and "already exists" in err

    status, err = run(["compute-image-mean", root / "db", root / "mean.binaryproto"], capsys)
    assert status == 0, err
    mean_blob = read_blobproto(str(root / "mean.binaryproto"))
    expected = np.mean([p[:, :, ::-1].transpose(2, 0, 1).astype(np.float32) for p in pixels.values()], axis=0)
    np.testing.assert_allclose(blobproto_to_array(mean_blob), expected[None], rtol=1e-6)
    for c in range(3):
        assert f"mean_value channel [{c}]: {expected[c].mean():g}" in err


def test_convert_imageset_encoded_gray_and_resized(images, capsys):
    from caffejax.data.data_layer import datum_image

    root, pixels = images
    status, err = run(["convert-imageset", "--encoded", f"{root}/", root / "list.txt", root / "enc"], capsys)
    assert status == 0, err
    for i, (key, value) in enumerate(read_lmdb(root / "enc")):
        datum = caffe_pb2.Datum.FromString(value)
        assert datum.encoded and datum.data == (root / f"img {i}.png").read_bytes()  # the file itself
        np.testing.assert_array_equal(datum_image(value, "color", key)[0],
                                      pixels[f"img {i}.png"][:, :, ::-1].transpose(2, 0, 1))
    status, err = run(["compute-image-mean", root / "enc"], capsys)
    assert status == 0 and "Number of channels: 3" in err

    status, err = run(["convert-imageset", "--gray", "--resize_height", "3", "--resize_width", "2", "--shuffle",
                       "--encode_type", "png", f"{root}/", root / "list.txt", root / "gray"], capsys)
    assert status == 0, err
    records = read_lmdb(root / "gray")
    assert sorted(key[9:] for key, _ in records) == sorted(pixels)
    for key, value in records:
        image, _ = datum_image(value, "unchanged", key)
        assert image.shape == (1, 3, 2)  # re-encoded: gray and resized


def test_lmdb_feeds_a_data_layer(images, capsys):
    """convert-imageset's database, read by a Data layer written with NetSpec."""
    root, pixels = images
    assert run(["convert-imageset", f"{root}/", root / "list.txt", root / "db"], capsys)[0] == 0
    n = caffejax.NetSpec()
    n.data, n.label = L.Data(source=str(root / "db"), backend=caffejax.params.Data.LMDB, batch_size=3,
                             transform_param=dict(scale=0.5), ntop=2)
    net = caffejax.Net(n.to_proto(), caffejax.TEST)
    out = net.forward()
    expected = [p[:, :, ::-1].transpose(2, 0, 1) * np.float32(0.5) for p in pixels.values()]
    np.testing.assert_array_equal(out["data"], np.stack(expected))
    np.testing.assert_array_equal(out["label"], [0, 1, 2])


def test_image_tools_bad_input(tmp_path, capsys):
    pytest.importorskip("lmdb")
    status, err = run(["compute-image-mean", tmp_path / "nodb"], capsys)
    assert status == 1 and error_lines(err) == [err.strip()] and "nodb" in err
    status, err = run(["convert-imageset", "--backend", "leveldb", f"{tmp_path}/", tmp_path / "l", tmp_path / "d"],
                      capsys)
    assert status == 1 and "leveldb" in err
    status, err = run(["convert-imageset", f"{tmp_path}/", tmp_path / "nolist.txt", tmp_path / "d"], capsys)
    assert status == 1 and "nolist.txt" in err and "Traceback" not in err


# ---- test, time ------------------------------------------------------------------------------------------------

def lenet_scoring_net(path):
    """LeNet (the bundled weights' layer names) scoring DummyData digits against label 3."""
    n = caffejax.NetSpec()
    n.data, n.label = L.DummyData(shape=[dict(dim=[4, 1, 28, 28]), dict(dim=[4])], ntop=2,
                                  data_filler=[dict(type="uniform"), dict(type="constant", value=3)])
    n.conv1 = L.Convolution(n.data, num_output=20, kernel_size=5)
    n.pool1 = L.Pooling(n.conv1, pool=caffejax.params.Pooling.MAX, kernel_size=2, stride=2)
    n.conv2 = L.Convolution(n.pool1, num_output=50, kernel_size=5)
    n.pool2 = L.Pooling(n.conv2, pool=caffejax.params.Pooling.MAX, kernel_size=2, stride=2)
    n.ip1 = L.InnerProduct(n.pool2, num_output=500)
    n.relu1 = L.ReLU(n.ip1, in_place=True)
    n.ip2 = L.InnerProduct(n.ip1, num_output=10)
    n.accuracy = L.Accuracy(n.ip2, n.label)
    n.loss = L.SoftmaxWithLoss(n.ip2, n.label)
    path.write_text(str(n.to_proto()))
    return path


def test_test_averages_outputs_like_caffe(tmp_path, capsys):
    model = lenet_scoring_net(tmp_path / "score.prototxt")
    status, err = run(["test", "-model", model, "-weights", LENET_WEIGHTS, "-iterations", "3"], capsys)
    assert status == 0, err
    batches = {name: [float(v) for v in re.findall(rf"Batch \d+, {name} = (\S+)", err)]
               for name in ("accuracy", "loss")}
    assert len(batches["accuracy"]) == len(batches["loss"]) == 3
    assert all(a in (0, 0.25, 0.5, 0.75, 1) for a in batches["accuracy"])
    accuracy = float(re.search(r"\] accuracy = (\S+)$", err, re.M).group(1))  # after the glog prefix
    assert accuracy == pytest.approx(np.mean(batches["accuracy"]), abs=1e-5)
    mean_loss = np.mean(batches["loss"])
    match = re.search(r" loss = (\S+) \(\* 1 = (\S+) loss\)$", err, re.M)
    assert float(match.group(1)) == pytest.approx(mean_loss, rel=1e-4) == float(match.group(2))
    assert float(re.search(r"Loss: (\S+)", err).group(1)) == pytest.approx(mean_loss, rel=1e-4)


def test_caffes_gpu_flag_is_accepted(tmp_path, capsys):
    """Scripts call caffe test -gpu 0: it runs where JAX runs, saying so when there is no GPU."""
    model = lenet_scoring_net(tmp_path / "score.prototxt")
    status, err = run(["test", "-model", model, "-weights", LENET_WEIGHTS, "-iterations", "1", "-gpu", "0"], capsys)
    assert status == 0, err
    import jax
    if jax.default_backend() != "gpu":
        assert "-gpu 0: JAX sees no GPU" in err
    status, err = run(["test", "-model", model, "-weights", LENET_WEIGHTS, "-gpu", "zero"], capsys)
    assert status == 1 and error_lines(err) == [err.strip()] and "-gpu takes device ids" in err


# caffe.cpp's time lines, as scripts read them (these two from benchmark scripts that parse `caffe time`).
NUMBER = r"[\d.]+(?:e[-+]\d+)?"
FORWARD_BACKWARD = re.compile(r"Average Forward-Backward:(\s+)(?P<ms>\d*\.*\d*(e\+\d+)*) ms\.")
GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ [\w.]+:\d+\] ")


def test_time_reports_layers_and_whole_net(capsys):
    status, err = run(["time", "-model", LENET, "-weights", LENET_WEIGHTS, "-iterations", "2"], capsys)
    assert status == 0, err
    import jax
    if jax.default_backend() == "cpu":
        assert re.search(r"\] Use CPU\.$", err, re.M)
    for line in ("Performing Forward", "Performing Backward", "*** Benchmark begins ***", "Testing for 2 iterations.",
                 "Average time per layer: ", "*** Benchmark ends ***"):
        assert re.search(rf"\] {re.escape(line)}$", err, re.M), line
    assert len(re.findall(rf"\] Iteration: [12] forward-backward time: {NUMBER} ms\.$", err, re.M)) == 2
    net = caffejax.Net(str(LENET), caffejax.TRAIN)
    for layer in net.graph.layers:  # every layer, the Input one too, with a number as Caffe prints it
        assert re.search(rf"\] +{layer.name}\tforward: {NUMBER} ms\.$", err, re.M), layer.name
        assert re.search(rf"\] +{layer.name}\tbackward: {NUMBER} ms\.$", err, re.M), layer.name
    assert re.search(r"\] +data\tforward: 0 ms\.$", err, re.M)  # fed: no work in the program, as InputLayer
    assert re.search(r"\] +relu1\tbackward: 0 ms\.$", err, re.M)  # no loss, so no diff below it
    assert float(re.search(rf"conv1\tbackward: ({NUMBER}) ms\.", err).group(1)) > 0  # its weights are learnable
    assert "each layer compiled on its own" in err
    averages = {name: float(re.search(rf"\] Average {name}: ({NUMBER}) ms\.$", err, re.M).group(1))
                for name in ("Forward pass", "Backward pass", "Forward-Backward")}
    assert averages["Forward pass"] > 0 and averages["Backward pass"] >= 0
    assert float(FORWARD_BACKWARD.search(err).group("ms")) == averages["Forward-Backward"] > 0
    iterations = [float(t) for t in re.findall(rf"forward-backward time: ({NUMBER}) ms", err)]
    total = float(re.search(rf"\] Total Time: ({NUMBER}) ms\.$", err, re.M).group(1))
    assert total == pytest.approx(sum(iterations), rel=1e-4) == pytest.approx(2 * averages["Forward-Backward"], rel=1e-4)
    # Caffe's closing lines come last, in its order.
    tail = [line.split("] ", 1)[1] for line in err.strip().splitlines()[-5:]]
    assert [line.split(":")[0] for line in tail] == ["Average Forward pass", "Average Backward pass",
                                                      "Average Forward-Backward", "Total Time",
                                                      "*** Benchmark ends ***"]
    # The whole programs traced, their operations charged to layers (fused ones joined by '+').
    for title in ("Forward pass", "Forward-Backward"):
        assert re.search(rf"Whole net's {title}, traced \(2 runs, [\d.e-]+ ms each\)", err), title
    assert re.search(r"[\d.]+ ms +[\d.]+%  forward +(\S+\+)?conv2(\+\S+)?  \(\d+ ops?\)", err)
    assert all(GLOG_LINE.match(line) for line in log_records(err))


def log_records(log: str) -> list[str]:
    """The log's lines, less the continuation lines of a record that spans several (the NetParameter Caffe
    prints after "Initializing net from parameters:")."""
    records, dump = [], False
    for line in log.strip().splitlines():
        if dump and GLOG_LINE.match(line):
            dump = False
        if not dump:
            records.append(line)
            dump = line.endswith("Initializing net from parameters: ")
    return records


def test_time_reads_a_batch_for_a_data_layers_forward(tmp_path, capsys):
    """A data layer's forward in caffe time is its next batch: here read on the host, a number, not 0."""
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "rows.h5", "w") as f:
        f.create_dataset("x", data=np.arange(12, dtype=np.float32).reshape(6, 2))
    (tmp_path / "list.txt").write_text(f"{tmp_path / 'rows.h5'}\n")
    (tmp_path / "net.prototxt").write_text(
        f'layer {{ name: "rows" type: "HDF5Data" top: "x" hdf5_data_param {{ source: "{tmp_path / "list.txt"}" '
        'batch_size: 2 } }\n'
        'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 1 } }\n')
    status, err = run(["time", "-model", tmp_path / "net.prototxt", "-iterations", "3"], capsys)
    assert status == 0, err
    assert float(re.search(rf"\] +rows\tforward: ({NUMBER}) ms\.$", err, re.M).group(1)) > 0
    assert re.search(rf"\] +rows\tbackward: 0 ms\.$", err, re.M)


def test_log_lines_have_glogs_form(capsys):
    """glog's prefix (severity, date, time to the microsecond, thread id, file:line]) on every line, warnings
    with W: Caffe's tools/extra/extract_seconds.py reads the date and time the way this does."""
    import datetime
    import logging

    from caffejax.runtime.mode import GlogFormatter

    record = logging.LogRecord("caffejax", logging.WARNING, "/x/solver.py", 42, "careful %s", ("now",), None)
    record.created = datetime.datetime(2026, 3, 7, 9, 5, 2, 123456).timestamp()
    line = GlogFormatter().format(record)
    assert GLOG_LINE.match(line) and line.startswith("W0307 09:05:02.123456 ") and line.endswith(
        " solver.py:42] careful now")
    fields = line.split()  # extract_seconds.extract_datetime_from_line
    month, day, timestamp = int(fields[0][1:3]), int(fields[0][3:]), fields[1]
    pos = timestamp.rfind(".")
    hour, minute, second = (int(x) for x in timestamp[:pos].split(":"))
    assert datetime.datetime(2026, month, day, hour, minute, second, int(timestamp[pos + 1:])) == \
        datetime.datetime(2026, 3, 7, 9, 5, 2, 123456)
    assert GlogFormatter().format(logging.LogRecord("caffejax", logging.CRITICAL, "a.py", 1, "x", (), None))[0] == "F"


def test_time_forward_backward_of_a_deploy_net_runs_its_forward():
    # LeNet's deploy net has no loss: its gradients are all zero, and a program returning only them would let
    # XLA drop the forward, so "Forward-Backward" came out shorter than "Forward pass".
    import jax

    from caffejax.cli.nets import whole_net_programs

    net = caffejax.Net(str(LENET), str(LENET_WEIGHTS), caffejax.TEST)
    assert not any(net.blob_loss_weights.values())
    x = np.random.default_rng(0).random(net.blobs["data"].shape, dtype=np.float32)
    expected = np.array(net.forward(data=x)["prob"])
    forward, forward_backward = whole_net_programs(net)
    args = (net.param_arrays(), {net.graph.fed["data"]: x}, jax.random.key(0))
    (prob,) = forward(*args)
    loss, grads, (prob_too,) = forward_backward(*args)
    np.testing.assert_allclose(prob, expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(prob_too, expected, rtol=1e-5, atol=1e-7)
    assert float(loss) == 0 and all(not np.any(np.asarray(g)) for gs in grads.values() for g in gs)


def test_time_forward_runs_layers_whose_blobs_only_silence_reads():
    # Caffe's Forward runs every layer; a branch ending in Silence is no output, and XLA would drop it.
    import jax

    from caffejax.cli.nets import whole_net_programs

    n = caffejax.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 3]))
    n.kept = L.InnerProduct(n.data, num_output=2, weight_filler=dict(type="constant", value=1))
    n.side = L.InnerProduct(n.data, num_output=4, weight_filler=dict(type="constant", value=2))
    n.silence = L.Silence(n.side, ntop=0)
    net = caffejax.Net(str(n.to_proto()), caffejax.TEST)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    forward, forward_backward = whole_net_programs(net)
    args = (net.param_arrays(), {net.graph.fed["data"]: x}, jax.random.key(0))
    for values in (forward(*args), forward_backward(*args)[2]):
        assert len(values) == 2  # the output and the silenced blob
        np.testing.assert_allclose(values[0], np.tile(x.sum(1, keepdims=True), 2))
        np.testing.assert_allclose(values[1], np.tile(2 * x.sum(1, keepdims=True), 4))


def test_time_folds_the_chains_net_forward_folds(monkeypatch):
    """time's programs hand back outputs only, so they fold a Convolution -> BatchNorm chain whose BatchNorm
    writes a new blob, as Net.forward does, and give Net.forward's outputs."""
    import jax

    from caffejax.cli.nets import whole_net_programs

    n = caffejax.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 3, 6, 6]))
    n.conv = L.Convolution(n.data, num_output=4, kernel_size=3, weight_filler=dict(type="gaussian", std=0.5))
    n.bn = L.BatchNorm(n.conv, batch_norm_param=dict(use_global_stats=True))
    n.out = L.ReLU(n.bn)
    net = caffejax.Net(str(n.to_proto()), caffejax.TEST)
    assert net._program.kernels["conv"].chain.visible
    net.params["bn"][0].data[...] = [1, -2, 0.5, 3]
    net.params["bn"][1].data[...] = [4, 1, 2, 0.5]
    net.params["bn"][2].data[...] = 2
    x = np.random.default_rng(0).normal(size=(2, 3, 6, 6)).astype(np.float32)
    expected = np.array(net.forward(data=x)["out"])
    seen = []
    for name in ("run_layers", "loss_and_grads"):
        method = getattr(net._program, name)
        monkeypatch.setattr(net._program, name, lambda *a, _m=method, **k: seen.append(k["fold_visible"]) or _m(*a, **k))
    forward, forward_backward = whole_net_programs(net)
    args = (net.param_arrays(), {net.graph.fed["data"]: x}, jax.random.key(0))
    np.testing.assert_allclose(forward(*args)[0], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(forward_backward(*args)[2][0], expected, rtol=1e-5, atol=1e-6)
    assert seen and all(seen)


def test_time_forward_runs_the_kernels_of_the_forward_backward(monkeypatch):
    """Net.forward alone runs its forward kernels (1x1 convolutions left to XLA), a training step the kernels of
    programs with a backward (products). time's whole-net forward runs the latter, the forward-backward's, so
    that the backward pass it reports (the forward-backward's time less the forward's) leaves the same forward
    out."""
    import jax

    from caffejax.cli.nets import whole_net_programs

    n = caffejax.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 3, 6, 6]))
    n.out = L.Convolution(n.data, num_output=4, kernel_size=1, weight_filler=dict(type="gaussian", std=0.5))
    net = caffejax.Net(str(n.to_proto()), caffejax.TEST)
    program = net._program
    assert program.kernels["out"].name == "conv_1x1_gemm" and program.forward_kernels["out"].name == "conv_nhwc"
    seen = []
    method = program.run_layers
    monkeypatch.setattr(program, "run_layers", lambda *a, **k: seen.append(k["kernels"]) or method(*a, **k))
    forward, _ = whole_net_programs(net)
    x = np.random.default_rng(0).normal(size=(2, 3, 6, 6)).astype(np.float32)
    (out,) = forward(net.param_arrays(), {net.graph.fed["data"]: x}, jax.random.key(0))
    assert seen and all(kernels is program.kernels for kernels in seen)
    np.testing.assert_allclose(out, np.array(net.forward(data=x)["out"]), rtol=1e-5, atol=1e-6)


# ---- train ------------------------------------------------------------------------------------------------------

def small_solver(tmp_path):
    n = caffejax.NetSpec()
    n.data, n.target = L.DummyData(shape=[dict(dim=[2, 3]), dict(dim=[2, 2])], ntop=2,
                                   data_filler=[dict(type="constant", value=1), dict(type="constant", value=0)])
    n.ip = L.InnerProduct(n.data, num_output=2, weight_filler=dict(type="constant", value=0.5))
    n.loss = L.EuclideanLoss(n.ip, n.target)
    (tmp_path / "net.prototxt").write_text(str(n.to_proto()))
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\nmax_iter: 2\ndisplay: 1\n'
        f'snapshot_prefix: "{tmp_path}/snap"\n')
    return tmp_path / "solver.prototxt"


def test_train_finetunes_and_resumes(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    solver = small_solver(tmp_path)
    start = caffejax.Net(str(tmp_path / "net.prototxt"), caffejax.TRAIN)
    start.params["ip"][0].data[...] = 0.25
    start.save(str(tmp_path / "start.caffemodel"))
    status, err = run(["train", "-solver", solver, "-weights", tmp_path / "start.caffemodel"], capsys)
    assert status == 0, err
    assert "Finetuning from" in err and "Optimization Done." in err
    assert "Iteration 0" in err and re.search(r"loss = 0\.5625\b", err)  # 2x2 outputs 0.75, loss sum/2/N
    trained = caffejax.Net(str(tmp_path / "net.prototxt"), str(tmp_path / "snap_iter_2.caffemodel"), caffejax.TRAIN)
    assert np.all(trained.params["ip"][0].data < 0.25)  # it moved toward the zero target

    status, err = run(["train", "-solver", solver, "-snapshot", tmp_path / "snap_iter_2.solverstate"], capsys)
    assert status == 0 and "Resuming from" in err

    status, err = run(["train", "-solver", solver, "-snapshot", "s", "-weights", "w"], capsys)
    assert status == 1 and error_lines(err) == [err.strip()] and "not both" in err
    status, err = run(["train", "-solver", solver, "--devices", "99"], capsys)
    assert status == 1 and len(error_lines(err)) == 1 and "devices=99: JAX sees" in err and "Traceback" not in err


def test_python_layers_run_only_with_the_flag(tmp_path, capsys, monkeypatch):
    """train, test and time refuse a net's Python layer, naming the flag that allows it, and run it with it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "caffejax_test_cli_pylayer.py").write_text(
        "import caffejax\n\n\nclass Rows(caffejax.Layer):\n"
        "    def setup(self, bottom, top):\n        pass\n\n"
        "    def reshape(self, bottom, top):\n        top[0].reshape(2, 3)\n\n"
        "    def forward(self, bottom, top):\n        top[0].data[...] = [[1, 2, 3], [4, 5, 6]]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "net.prototxt").write_text(
        'layer { name: "rows" type: "Python" top: "x" python_param { module: "caffejax_test_cli_pylayer" '
        'layer: "Rows" } }\n'
        'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 2 } }\n'
        'layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "y" top: "loss" }\n')
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt" base_lr: 0.1 lr_policy: "fixed" max_iter: 2 '
                                              'snapshot_after_train: false')
    for argv in (["train", "-solver", "solver.prototxt"], ["time", "-model", "net.prototxt", "-iterations", "1"]):
        status, err = run(argv, capsys)
        assert status == 1 and "layer 'rows' (type Python)" in err and "--allow-python-layers" in err, err
        status, err = run(argv + ["--allow-python-layers"], capsys)
        assert status == 0, err
    net = caffejax.Net("net.prototxt", caffejax.TEST, allow_python_layers=True)
    net.save("w.caffemodel")
    status, err = run(["test", "-model", "net.prototxt", "-weights", "w.caffemodel", "-iterations", "1",
                       "--allow-python-layers"], capsys)
    assert status == 0 and "loss = 0" in err, err


def test_train_on_two_devices(tmp_path):
    """--devices N reaches the data-parallel solver (two CPU devices, in a process of its own)."""
    solver = small_solver(tmp_path)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run([sys.executable, "-m", "caffejax.cli", "train", "-solver", str(solver), "--devices", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "snap_iter_2.caffemodel").exists() and "Optimization Done." in done.stderr


# ---- draw, export ------------------------------------------------------------------------------------------------

def test_draw(tmp_path, capsys):
    status, err = run(["draw", LENET, tmp_path / "lenet.dot", "--rankdir", "TB"], capsys)
    assert status == 0, err
    text = (tmp_path / "lenet.dot").read_text()
    assert "rankdir=TB" in text and all(f'"layer {name} (' in text for name in ("data", "conv1", "ip2", "prob"))
    if shutil.which("dot"):
        assert run(["draw", LENET, tmp_path / "lenet.png"], capsys)[0] == 0
        assert (tmp_path / "lenet.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_export(tmp_path, capsys):
    pytest.importorskip("flatbuffers")
    from caffejax.export import load_stablehlo

    status, err = run(["export", "-model", LENET, "-weights", LENET_WEIGHTS, "-output", tmp_path / "lenet.shlo",
                       "--batch", "2", "--platforms", "cpu,cuda"], capsys)
    assert status == 0, err
    model = load_stablehlo(str(tmp_path / "lenet.shlo"))
    assert model.exported.platforms == ("cpu", "cuda")  # lowered for a GPU too, and runs here on the CPU
    x = np.random.default_rng(0).random((2, 1, 28, 28), dtype=np.float32)
    net = caffejax.Net(str(LENET), str(LENET_WEIGHTS), caffejax.TEST)
    net.blobs["data"].reshape(2, 1, 28, 28)
    np.testing.assert_allclose(model(data=x)["prob"], net.forward(data=x)["prob"], rtol=1e-5, atol=1e-5)

    # a symbolic batch: one program for every batch size
    status, err = run(["export", "-model", LENET, "-weights", LENET_WEIGHTS, "-output", tmp_path / "any.shlo",
                       "--batch", "batch", "--batch-inputs", "data"], capsys)
    assert status == 0, err
    model = load_stablehlo(str(tmp_path / "any.shlo"))
    assert model.input_shapes == {"data": ("batch", 1, 28, 28)}
    np.testing.assert_allclose(model(data=x[:1])["prob"], net.forward(data=x)["prob"][:1], rtol=1e-5, atol=1e-5)
    status, err = run(["export", "-model", LENET, "-weights", LENET_WEIGHTS, "-output", tmp_path / "bf16.shlo",
                       "--batch", "batch", "--dtype", "bfloat16"], capsys)
    assert status == 0, err
    model = load_stablehlo(str(tmp_path / "bf16.shlo"))
    assert model.exported.fun_name.startswith("caffejax_bfloat16_forward")
    np.testing.assert_array_equal(np.asarray(model(data=x)["prob"]).argmax(1), net.forward(data=x)["prob"].argmax(1))
    status, err = run(["export", "-model", LENET, "-weights", LENET_WEIGHTS, "-output", tmp_path / "bad.shlo",
                       "--batch", "2x"], capsys)
    assert status == 1 and "--batch takes a whole number or a name (a symbolic batch), got '2x'" in err
    status, err = run(["export", "-model", LENET, "-weights", LENET_WEIGHTS, "-output", tmp_path / "x.msgpack",
                       "--format", "flax", "--dtype", "bfloat16"], capsys)
    assert status == 1 and "--dtype and --platforms apply to --format stablehlo only" in err

    pytest.importorskip("flax")
    status, err = run(["export", "-model", LENET, "-weights", LENET_WEIGHTS, "-output", tmp_path / "lenet.msgpack",
                       "--format", "flax"], capsys)
    assert status == 0, err
    assert (tmp_path / "lenet.msgpack").stat().st_size > 4 * 431_000  # LeNet's 431k weights


# ---- bad input ----------------------------------------------------------------------------------------------------

def test_bad_input_is_one_line_and_status_1(tmp_path, capsys):
    status, err = run(["test", "-model", tmp_path / "none.prototxt", "-weights", LENET_WEIGHTS], capsys)
    assert status == 1 and err.strip() == f"caffejax: error: {tmp_path / 'none.prototxt'}: no such model file"
    status, err = run(["test", "-model", LENET, "-weights", tmp_path / "none.caffemodel"], capsys)
    assert status == 1 and error_lines(err) == [err.strip()] and "none.caffemodel" in err
    (tmp_path / "broken.prototxt").write_text('layer { name: "a" type: "Input" top: "a" }\n'
                                              'layer { name: "b" type: "ReLU" bottom: "missing" top: "b" }\n')
    status, err = run(["time", "-model", tmp_path / "broken.prototxt"], capsys)
    assert status == 1 and error_lines(err) == [err.strip()] and "missing" in err
    status, err = run(["test", "-model", LENET, "-weights", LENET_WEIGHTS, "-phase", "VALIDATE"], capsys)
    assert status == 1 and "TRAIN or TEST" in err
    with pytest.raises(caffejax.CaffejaxError):  # --debug shows the real exception
        main(["--debug", "time", "-model", str(tmp_path / "broken.prototxt")])


def test_console_script_smoke():
    exe = shutil.which("caffejax")
    if exe is None:
        pytest.skip("the caffejax console script is not installed (pip install -e .)")
    done = subprocess.run([exe, "upgrade", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage: caffejax upgrade" in done.stdout
    done = subprocess.run([exe, "draw", "/nonexistent.prototxt", "x.dot"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and done.stderr.strip() == "caffejax: error: /nonexistent.prototxt: no such model file"


# ---- checked against BVLC's tools/*.cpp ----------------------------------------------------------------------

def test_train_weights_flag_replaces_the_solvers_weights(tmp_path, capsys, monkeypatch):
    """caffe.cpp's train clears the solver's `weights` for -snapshot, and replaces them with -weights (caffejax
    loaded the solver's files too: a missing one failed a resume, and their layers overrode the fillers)."""
    monkeypatch.chdir(tmp_path)
    small_solver(tmp_path)
    own = caffejax.Net(str(tmp_path / "net.prototxt"), caffejax.TRAIN)
    own.params["ip"][0].data[...] = 9
    own.save(str(tmp_path / "solvers_own.caffemodel"))
    # Weights for another net: finetuning from them leaves every layer here to its filler.
    (tmp_path / "other.caffemodel").write_bytes(caffe_pb2.NetParameter(name="other").SerializeToString())
    solver = tmp_path / "solver.prototxt"
    common = f'net: "net.prototxt"\nlr_policy: "fixed"\nsnapshot_prefix: "{tmp_path}/snap"\n'
    solver.write_text(common + 'weights: "solvers_own.caffemodel"\nbase_lr: 0\nmax_iter: 1\n')
    status, err = run(["train", "-solver", solver, "-weights", "other.caffemodel"], capsys)
    assert status == 0, err
    assert "Finetuning from other.caffemodel" in err and "solvers_own" not in err
    trained = caffejax.Net(str(tmp_path / "net.prototxt"), str(tmp_path / "snap_iter_1.caffemodel"), caffejax.TRAIN)
    np.testing.assert_array_equal(trained.params["ip"][0].data, 0.5)  # the filler's, not the solver's file's

    solver.write_text(common + 'weights: "gone.caffemodel"\nbase_lr: 0.1\nmax_iter: 2\n')
    status, err = run(["train", "-solver", solver, "-snapshot", "snap_iter_1.solverstate"], capsys)
    assert status == 0, err
    assert (tmp_path / "snap_iter_2.caffemodel").is_file() and "gone.caffemodel" not in err


def test_train_level_flag_always_sets_the_train_state(tmp_path, capsys, monkeypatch):
    """caffe.cpp sets train_state.level from -level, 0 when not given, over the solver file's own train_state."""
    monkeypatch.chdir(tmp_path)
    solver = small_solver(tmp_path)
    net = (tmp_path / "net.prototxt").read_text()
    # A second loss only at level >= 1: the train net has it only when -level is 1.
    extra = ('layer { name: "loss2" type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "loss2" '
             'include { min_level: 1 } }\n')
    (tmp_path / "net.prototxt").write_text(net + extra)
    solver.write_text(solver.read_text() + "train_state { level: 1 }\n")
    status, err = run(["train", "-solver", solver], capsys)
    assert status == 0, err
    assert "Creating Layer loss2" not in err and re.search(r"Iteration 0 .* loss = 2\.25$", err, re.M)
    assert "The NetState level (0) is above the min_level (1) specified by a rule in layer loss2" in err  # Caffe's words
    status, err = run(["train", "-solver", solver, "-level", "1"], capsys)
    assert status == 0 and re.search(r"Iteration 0 .* loss = 4\.5$", err, re.M), err


def test_test_sums_outputs_in_float32_like_caffe(tmp_path, capsys):
    """caffe.cpp's test adds the batches' outputs and losses in float: 1e8 + 1 - 1e8 is 0 there, and its mean
    prints as 0 (caffejax summed in double and printed 0.333333)."""
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "rows.h5", "w") as f:
        f.create_dataset("x", data=np.array([[1e8], [1], [-1e8]], np.float32))
    (tmp_path / "list.txt").write_text(f"{tmp_path / 'rows.h5'}\n")
    (tmp_path / "net.prototxt").write_text(
        f'layer {{ name: "rows" type: "HDF5Data" top: "x" hdf5_data_param {{ source: "{tmp_path / "list.txt"}" '
        'batch_size: 1 } }\n'
        'layer { name: "copy" type: "Power" bottom: "x" top: "y" loss_weight: 2 }\n')
    caffejax.Net(str(tmp_path / "net.prototxt"), caffejax.TEST).save(str(tmp_path / "w.caffemodel"))
    status, err = run(["test", "-model", tmp_path / "net.prototxt", "-weights", tmp_path / "w.caffemodel",
                       "-iterations", "3"], capsys)
    assert status == 0, err
    assert re.findall(r"Batch \d, y = (\S+)", err) == ["1e+08", "1", "-1e+08"]
    assert re.search(r"Loss: (\S+)$", err, re.M).group(1) == "0"
    assert re.search(r"\] y = (.*)$", err, re.M).group(1) == "0 (* 2 = 0 loss)"  # after the glog prefix


def test_device_query_takes_the_gpu_flag(capsys):
    """Caffe's documented `caffe device_query -gpu 0` (caffejax refused -gpu there)."""
    status, err = run(["device_query", "-gpu", "0"], capsys)
    assert status == 0 and "Querying GPUs 0" in err and "Device 0:" in err, err
    status, err = run(["device_query", "-gpu", "999"], capsys)
    assert status == 1 and len(error_lines(err)) == 1 and "-gpu 999: no such device" in err


def test_glog_minloglevel_keeps_the_tools_lower_lines_out_as_caffes_tool_does(monkeypatch, capsys):
    """GLOG_minloglevel (as Caffe's tool reads it through glog): 1 drops the INFO lines; an error still shows."""
    monkeypatch.setenv("GLOG_minloglevel", "1")
    status, err = run(["device_query", "-gpu", "0"], capsys)
    assert status == 0 and err == "", err
    status, err = run(["device_query", "-gpu", "999"], capsys)
    assert status == 1 and len(error_lines(err)) == 1 and "-gpu 999: no such device" in err


def test_convert_imageset_reads_gflags_booleans(images, capsys):
    """gflags' spellings of a boolean: -shuffle=true, --gray=false, -noencoded (argparse refused them)."""
    root, pixels = images
    status, err = run(["convert_imageset", "-shuffle=true", "--gray=false", "-noencoded", "--check_size=1",
                       f"{root}/", root / "list.txt", root / "db"], capsys)
    assert status == 0, err
    assert "Shuffling data" in err
    records = read_lmdb(root / "db")
    assert sorted(key[9:] for key, _ in records) == sorted(pixels)
    assert all(caffe_pb2.Datum.FromString(value).channels == 3 for _, value in records)
    status, err = run(["convert_imageset", "-gray=maybe", f"{root}/", root / "list.txt", root / "db2"], capsys)
    assert status == 1 and error_lines(err) == [err.strip()] and "illegal value 'maybe'" in err


def test_convert_imageset_keys_count_blank_lines(images, capsys):
    """A blank line is a line to convert_imageset (its image is not found): the lines after it keep their
    numbers in the keys."""
    root, pixels = images
    names = list(pixels)
    (root / "blank.txt").write_text(f"{names[0]} 0\n\n{names[1]} 1\n")
    status, err = run(["convert-imageset", f"{root}/", root / "blank.txt", root / "db"], capsys)
    assert status == 0, err
    assert "A total of 3 images." in err
    assert [key for key, _ in read_lmdb(root / "db")] == [f"00000000_{names[0]}", f"00000002_{names[1]}"]


def test_convert_imageset_lines_end_at_newline_only(images, capsys):
    """std::getline splits the list at "\n" only: "a 0\rb 1" is one line, naming the image "a 0\rb" (not
    found) with label 1; a "\r" before the "\n" stays in the label, which atoi stops at."""
    root, pixels = images
    names = list(pixels)
    (root / "cr.txt").write_bytes(f"{names[0]} 0\r{names[1]} 1\n{names[2]} 2\r\n".encode())
    status, err = run(["convert-imageset", f"{root}/", root / "cr.txt", root / "db"], capsys)
    assert status == 0, err
    assert "A total of 2 images." in err
    records = read_lmdb(root / "db")
    assert [key for key, _ in records] == [f"00000001_{names[2]}"]
    assert caffe_pb2.Datum.FromString(records[0][1]).label == 2


def test_compute_image_mean_channel_means_sum_like_caffe(tmp_path, capsys):
    """compute_image_mean adds a channel's means one by one into a float: the logged mean_value is that sum's,
    to its 6th digit (NumPy's pairwise sum printed 86.1716 here, Caffe 86.1715)."""
    lmdb = pytest.importorskip("lmdb")
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, (3, 1, 128, 128), dtype=np.uint8)
    env = lmdb.open(str(tmp_path / "db"), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i, image in enumerate(images):
            datum = caffe_pb2.Datum(channels=1, height=128, width=128, data=image.tobytes(), label=0)
            txn.put(f"{i:08d}".encode(), datum.SerializeToString())
    env.close()
    status, err = run(["compute_image_mean", tmp_path / "db", tmp_path / "mean.binaryproto"], capsys)
    assert status == 0, err
    mean = images.astype(np.float32).sum(axis=0, dtype=np.float32) / np.float32(3)
    total = np.float32(0)
    for value in mean.ravel():  # caffe: mean_values[c] += sum_blob.data(dim * c + i)
        total = np.float32(total + value)
    caffe_line = f"{float(total / np.float32(128 * 128)):g}"
    assert re.search(r"mean_value channel \[0\]: (\S+)$", err, re.M).group(1) == caffe_line
    np.testing.assert_array_equal(blobproto_to_array(read_blobproto(str(tmp_path / "mean.binaryproto")))[0], mean)


def _signalling_solver(tmp_path, monkeypatch, signal_name: str, at_forward: int):
    """A solver whose net's Python data layer sends this process ``signal_name`` in its ``at_forward``-th
    forward (during iteration at_forward - 1), as a user pressing Ctrl-C or a `kill -HUP` would."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "caffejax_test_cli_signals.py").write_text(
        "import os, signal\nimport caffejax\n\n\nclass Rows(caffejax.Layer):\n"
        "    def setup(self, bottom, top):\n        self.name, at = self.param_str.split(':')\n"
        "        self.at, self.calls = int(at), 0\n\n"
        "    def reshape(self, bottom, top):\n        top[0].reshape(2, 3)\n\n"
        "    def forward(self, bottom, top):\n        self.calls += 1\n"
        "        if self.calls == self.at:\n            os.kill(os.getpid(), getattr(signal, self.name))\n"
        "        top[0].data[...] = [[1, 2, 3], [4, 5, 6]]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "net.prototxt").write_text(
        'layer { name: "rows" type: "Python" top: "x" python_param { module: "caffejax_test_cli_signals" '
        f'layer: "Rows" param_str: "{signal_name}:{at_forward}" }} }}\n'
        'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 2 } }\n'
        'layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "y" top: "loss" }\n')
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt" base_lr: 0.01 lr_policy: "fixed" max_iter: 6 '
                                              'snapshot_prefix: "snap"')
    return ["train", "-solver", "solver.prototxt", "--allow-python-layers"]


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="SIGHUP is POSIX")
def test_train_acts_on_sigint_and_sighup_as_caffe_train_does(tmp_path, capsys, monkeypatch):
    """caffe train's -sigint_effect (default stop) and -sighup_effect (default snapshot): the solver finishes
    the iteration the signal came in, then stops with its final snapshot, or snapshots and goes on."""
    # Put back after training: the handlers the process had, which are not Python's default where it started
    # with the signals ignored (`nohup`, a shell's background job: SIG_IGN).
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGHUP)
    argv = _signalling_solver(tmp_path, monkeypatch, "SIGINT", 3)
    status, err = run(argv, capsys)
    assert status == 0 and "Optimization stopped early." in err, err
    assert sorted(p.name for p in tmp_path.glob("snap_iter_*.caffemodel")) == ["snap_iter_3.caffemodel"]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGHUP)) == before

    for p in tmp_path.glob("snap_iter_*"):
        p.unlink()
    argv = _signalling_solver(tmp_path, monkeypatch, "SIGHUP", 3)
    status, err = run(argv, capsys)
    assert status == 0 and "Optimization stopped early." not in err, err
    assert sorted(p.name for p in tmp_path.glob("snap_iter_*.caffemodel")) == ["snap_iter_3.caffemodel",
                                                                               "snap_iter_6.caffemodel"]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGHUP)) == before

    for p in tmp_path.glob("snap_iter_*"):
        p.unlink()
    argv = _signalling_solver(tmp_path, monkeypatch, "SIGINT", 3)
    status, err = run(argv + ["-sigint_effect", "none"], capsys)
    assert status == 0 and "Optimization stopped early." not in err, err
    assert sorted(p.name for p in tmp_path.glob("snap_iter_*.caffemodel")) == ["snap_iter_6.caffemodel"]

    status, err = run(argv + ["-sighup_effect", "halt"], capsys)
    assert status == 1 and "invalid choice: 'halt'" in err and len(error_lines(err)) == 1, err


def caffe_log_rows(log: str, year: int | None = None) -> tuple[list[dict], list[dict]]:
    """The train and test rows Caffe's tools/extra/parse_log.py (master) reads off a log, as it reads them: the
    clock of each line after the first 'Iteration' from glog's prefix (extract_seconds.py), counted from the
    'Solving' line; outputs gathered into one row per iteration; the first row's learning rate from the second.
    glog's prefix has no year: parse_log takes the log file's, ``year`` here (default: this year's, the log's
    just written; a fixed one would fail on a leap day, February 29 being no date in a common year)."""
    year = datetime.date.today().year if year is None else year

    def clock_of(line):
        fields = line.strip().split()
        stamp = fields[1]
        pos = stamp.rfind(".")
        hour, minute, second = (int(x) for x in stamp[:pos].split(":"))
        return datetime.datetime(year, int(fields[0][1:3]), int(fields[0][3:]), hour, minute, second,
                                 int(stamp[pos + 1:]))

    lines = log.splitlines()
    solving = next(i for i, line in enumerate(lines) if "Solving" in line)
    start, iteration, rate = clock_of(lines[solving]), -1.0, float("nan")
    tables: dict[str, list[dict]] = {"Train": [], "Test": []}
    rows: dict[str, dict | None] = {"Train": None, "Test": None}
    for line in lines[solving + 1:]:
        if match := re.search(r"Iteration (\d+)", line):
            iteration = float(match.group(1))
        if iteration == -1:
            continue
        seconds = (clock_of(line) - start).total_seconds()
        if match := re.search(r"lr = ([-+]?[0-9]*\.?[0-9]+([eE]?[-+]?[0-9]+)?)", line):
            rate = float(match.group(1))
        for kind, table in tables.items():
            row = rows[kind]
            if match := re.search(rf"{kind} net output #(\d+): (\S+) = ([\.\deE+-]+)", line):
                if not row or row["NumIters"] != iteration:
                    if row:
                        table.append(row)
                    row = {"NumIters": iteration, "Seconds": seconds, "LearningRate": rate}
                row[match.group(2)] = float(match.group(3))
            if row and table and len(row) == len(table[0]):
                table.append(row)
                row = None
            rows[kind] = row
    for table in tables.values():
        if len(table) > 1:
            table[0]["LearningRate"] = table[1]["LearningRate"]
    return tables["Train"], tables["Test"]


def test_a_training_log_reads_with_caffes_parse_log(tmp_path, capsys, monkeypatch):
    """caffejax train's log through parse_log.py's reading: every line after the first iteration has glog's
    prefix (parse_log stops at one that has not), and the train and test outputs come out as Caffe's would."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(
        'layer { name: "d" type: "DummyData" top: "data" top: "label" dummy_data_param { shape { dim: 4 dim: 3 } '
        'shape { dim: 4 } data_filler { type: "gaussian" } data_filler { type: "constant" value: 1 } } }\n'
        'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 3 '
        'weight_filler { type: "xavier" } } }\n'
        'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }\n'
        'layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" '
        'include { phase: TEST } }\n')
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\nmax_iter: 6\ndisplay: 2\ntest_iter: 2\n'
        'test_interval: 3\nsnapshot_prefix: "snap"\n')
    status, err = run(["train", "-solver", "solver.prototxt"], capsys)
    assert status == 0, err
    import jax
    if jax.default_backend() == "cpu":
        assert re.search(r"\] Use CPU\.$", err, re.M)  # caffe train's line, before the solver's
        assert err.index("Use CPU.") < err.index("Initializing solver from parameters")
    assert err.index("Solver scaffolding done.") < err.index("Starting Optimization") < err.index("Solving")
    train, test = caffe_log_rows(err)
    losses = [float(x) for x in re.findall(r"Iteration \d+ \(.*\), loss = (\S+)", err)]
    assert [row["NumIters"] for row in train] == [0, 2, 4] and [row["loss"] for row in train] == losses
    assert all(row["LearningRate"] == 0.1 for row in train)
    assert [row["NumIters"] for row in test] == [0, 3, 6] and all(set(row) >= {"accuracy", "loss"} for row in test)
    seconds = [row["Seconds"] for row in train + test]
    assert all(s >= 0 for s in seconds) and [row["Seconds"] for row in train] == sorted(row["Seconds"] for row in train)


FEATURE_NET = """
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TEST }
        transform_param { scale: 0.00390625 } data_param { source: "%s" batch_size: 2 backend: LMDB } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 2 kernel_size: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
"""


def test_extract_features_stores_each_images_blobs_as_caffe_does(tmp_path, capsys):
    """extract_features: NUM_MINI_BATCHES forwards of the TEST net; each named blob's items, one Datum each
    (float_data, the blob's legacy channels x height x width), under keys 0000000000, 0000000001, ... in a
    new LMDB per blob: the values of a net run on the same batches (the data layer wraps around its 5 images)."""
    lmdb = pytest.importorskip("lmdb")
    images = np.random.default_rng(4).integers(0, 256, (5, 1, 8, 8), dtype=np.uint8)
    env = lmdb.open(str(tmp_path / "images"), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i, image in enumerate(images):
            datum = caffe_pb2.Datum(channels=1, height=8, width=8, data=image.tobytes(), label=i)
            txn.put(f"{i:08d}".encode(), datum.SerializeToString())
    env.close()
    (tmp_path / "net.prototxt").write_text(FEATURE_NET % (tmp_path / "images"))
    reference = caffejax.Net(str(tmp_path / "net.prototxt"), caffejax.TEST)
    reference.save(str(tmp_path / "w.caffemodel"))
    expected = {"conv": [], "ip": []}
    for _ in range(3):
        blobs = reference.forward(blobs=["conv", "ip"])
        for name in expected:
            expected[name].extend(np.array(blobs[name]))
    argv = ["extract_features", tmp_path / "w.caffemodel", tmp_path / "net.prototxt", "conv,ip",
            f"{tmp_path / 'conv_db'},{tmp_path / 'ip_db'}", 3, "lmdb", "CPU"]
    status, err = run(argv, capsys)
    assert status == 0, err
    for line in ("Extracted features of 6 query images for feature blob conv",
                 "Extracted features of 6 query images for feature blob ip", "Successfully extracted the features!"):
        assert line in err
    for name, shape in (("conv", (2, 6, 6)), ("ip", (3, 1, 1))):
        env = lmdb.open(str(tmp_path / f"{name}_db"), readonly=True, lock=False)
        with env.begin() as txn:
            records = list(txn.cursor())
        env.close()
        assert [key for key, _ in records] == [f"{i:010d}".encode() for i in range(6)]
        for (_, value), item in zip(records, expected[name]):
            datum = caffe_pb2.Datum.FromString(value)
            assert (datum.channels, datum.height, datum.width) == shape and not datum.data
            np.testing.assert_allclose(np.array(datum.float_data, np.float32), item.ravel(), rtol=1e-5, atol=1e-6)
    assert not np.allclose(expected["ip"][0], expected["ip"][1])  # the batches differ
    status, err = run(argv, capsys)
    assert status == 1 and "conv_db: already exists" in err
    for names, message in ((["conv", "a,b"], "the number of blob names \\(1\\) and dataset names \\(2\\)"),
                           (["fc9", "c"], "Unknown feature blob name fc9 in the network")):
        status, err = run(argv[:3] + names + argv[5:], capsys)
        assert status == 1 and re.search(message, err), err


def test_no_stage_flag_is_one_empty_stage_as_in_caffe(tmp_path, capsys):
    """caffe.cpp splits -stage at ',' (boost::split), so without -stage a net gets one empty stage: its logged
    state reads level 0 and stage "" as Caffe's logs do, and a rule naming not_stage: "" drops its layer."""
    (tmp_path / "net.prototxt").write_text(
        'layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }\n'
        'layer { name: "gone" type: "ReLU" bottom: "x" top: "y" exclude { stage: "" } }\n'
        'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "z" inner_product_param { num_output: 2 } }\n')
    status, err = run(["time", "-model", tmp_path / "net.prototxt", "-iterations", "1", "-phase", "TEST"], capsys)
    assert status == 0, err
    assert 'state {\n  phase: TEST\n  level: 0\n  stage: ""\n}' in err
    assert "Creating Layer ip" in err and "Creating Layer gone" not in err
    status, err = run(["time", "-model", tmp_path / "net.prototxt", "-iterations", "1", "-phase", "TEST",
                       "-stage", "deploy"], capsys)
    assert status == 0 and 'stage: "deploy"\n}' in err and "Creating Layer gone" in err
