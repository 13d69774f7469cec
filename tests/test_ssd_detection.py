"""SSD's DetectionOutput (weiliu89/caffe's detection_output_layer.cpp): decoding, per-class NMS and keep_top_k,
by hand and against OpenCV's reading of the same layer; and how a layer whose top shape depends on the data runs:
on the host, after the compiled program (Layer.runs_on_host)."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

import caffejax
from caffejax.export import export_stablehlo
from caffejax.frontend import prototxt
from caffejax.frontend.prototxt import ForkEnum, ForkMessage, ForkParam, ForkParamField, register_fork_param
from caffejax.lower import forks
from caffejax.runtime.solver import summed_scores
from conftest import input_layer

# Four priors (xmin, ymin, xmax, ymax): B overlaps A by 0.818 (IoU), D overlaps C by 0.6.
PRIORS = np.float32([[0.1, 0.1, 0.3, 0.3], [0.12, 0.1, 0.32, 0.3], [0.5, 0.5, 0.9, 0.9], [0.6, 0.5, 1.0, 0.9]])
VARIANCES = np.float32([0.1, 0.1, 0.2, 0.2])
# Scores per prior for classes 0 (background), 1 and 2.
SCORES = np.float32([[0.05, 0.9, 0.05], [0.1, 0.8, 0.1], [0.1, 0.3, 0.6], [0.25, 0.05, 0.7]])
A, B, C, D = range(4)


def _prior_blob() -> np.ndarray:
    return np.stack([PRIORS.reshape(-1), np.tile(VARIANCES, 4)])[None]


def _detection_net(param: str, images: int = 1, loc_classes: int = 1) -> caffejax.Net:
    forks.register_detection_output()
    return caffejax.Net(input_layer(images, 4 * 4 * loc_classes, name="loc") + input_layer(images, 4 * 3, name="conf")
                        + input_layer(1, 2, 16, name="prior")
                        + 'layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" '
                          f'top: "det" detection_output_param {{ num_classes: 3 {param} }} }}\n', caffejax.TEST)


def _detect(param: str, loc=None, scores=SCORES, images: int = 1, loc_classes: int = 1) -> np.ndarray:
    net = _detection_net(param, images, loc_classes)
    loc = np.zeros((images, 4 * 4 * loc_classes), np.float32) if loc is None else loc
    conf = np.broadcast_to(scores.reshape(-1), (images, 12))
    return np.asarray(net.forward(loc=loc, conf=conf, prior=_prior_blob())["det"])


def _rows(*found) -> np.ndarray:
    """Expected rows [image, label, score, box] for (image, label, prior) with the prior's own box (loc 0)."""
    return np.float32([[i, c, SCORES[p, c], *PRIORS[p]] for i, c, p in found]).reshape(1, 1, len(found), 7)


def test_detection_output_nms_keeps_the_best_box_of_each_overlapping_group(isolated_registry):
    """Per class, scores above confidence_threshold in descending order; a box is kept when its overlap with every
    box kept before is at most nms_threshold. Rows by image, then label, then the order kept; the background
    class (0) gives none. With zero offsets, CENTER_SIZE decodes each prior to itself."""
    got = _detect("nms_param { nms_threshold: 0.45 } code_type: CENTER_SIZE confidence_threshold: 0.2")
    np.testing.assert_allclose(got, _rows((0, 1, A), (0, 1, C), (0, 2, D)), rtol=1e-6, atol=1e-7)
    # At 0.7, C's overlap of 0.6 with D is allowed; eta 0.8 lowers the threshold to 0.56 once D is kept.
    loose = "code_type: CENTER_SIZE confidence_threshold: 0.2 nms_param { nms_threshold: 0.7"
    np.testing.assert_allclose(_detect(loose + " }"), _rows((0, 1, A), (0, 1, C), (0, 2, D), (0, 2, C)),
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(_detect(loose + " eta: 0.8 }"), _rows((0, 1, A), (0, 1, C), (0, 2, D)),
                               rtol=1e-6, atol=1e-7)
    # top_k: at most that many candidates per class enter NMS.
    np.testing.assert_allclose(_detect("nms_param { nms_threshold: 0.45 top_k: 1 } code_type: CENTER_SIZE"),
                               _rows((0, 1, A), (0, 2, D)), rtol=1e-6, atol=1e-7)
    # keep_top_k: the best 2 over all classes (A's 0.9 and D's 0.7), then grouped by label again.
    np.testing.assert_allclose(_detect("nms_param { nms_threshold: 0.45 } code_type: CENTER_SIZE keep_top_k: 2 "
                                       "confidence_threshold: 0.2"), _rows((0, 1, A), (0, 2, D)), rtol=1e-6, atol=1e-7)
    # Without a confidence_threshold every score counts; background_label_id picks the class left out. Class 0:
    # D, then B and C tie at 0.1 and keep prior order (a stable sort): B stays, C overlaps D; A overlaps B.
    np.testing.assert_allclose(_detect("nms_param { nms_threshold: 0.45 } code_type: CENTER_SIZE "
                                       "background_label_id: 2"),
                               _rows((0, 0, D), (0, 0, B), (0, 1, A), (0, 1, C)), rtol=1e-6, atol=1e-7)


def test_detection_output_without_detections_gives_one_row_per_image(isolated_registry):
    got = _detect("code_type: CENTER_SIZE confidence_threshold: 0.95", images=2)
    np.testing.assert_array_equal(got, [[[[0, -1, -1, -1, -1, -1, -1], [1, -1, -1, -1, -1, -1, -1]]]])


def test_detection_output_decodes_each_code_type(isolated_registry):
    """DecodeBBox: CORNER adds variance-scaled offsets to the corners, CORNER_SIZE scales them by the prior's size
    too, CENTER_SIZE moves the centre and scales width and height by exp; variance_encoded_in_target leaves the
    variances out. The box comes out unclipped (Caffe's decoding does not clip)."""
    offsets = np.float32([1.0, -1.0, 0.5, 2.0])
    loc = np.zeros((1, 16), np.float32)
    loc[0, :4] = offsets
    (x0, y0, x1, y1), (v0, v1, v2, v3) = PRIORS[A].astype(np.float64), VARIANCES.astype(np.float64)
    w, h = x1 - x0, y1 - y0
    cx, cy = v0 * offsets[0] * w + (x0 + x1) / 2, v1 * offsets[1] * h + (y0 + y1) / 2
    bw, bh = np.exp(v2 * offsets[2]) * w, np.exp(v3 * offsets[3]) * h
    cw, ch = np.exp(offsets[2]) * w, np.exp(offsets[3]) * h
    expected = {
        "CORNER": [x0 + v0 * 1, y0 - v1 * 1, x1 + v2 * 0.5, y1 + v3 * 2],
        "CORNER_SIZE": [x0 + v0 * w, y0 - v1 * h, x1 + v2 * 0.5 * w, y1 + v3 * 2 * h],
        "CENTER_SIZE": [cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2],
        "CENTER_SIZE variance_encoded_in_target: true": [w + (x0 + x1) / 2 - cw / 2, -h + (y0 + y1) / 2 - ch / 2,
                                                         w + (x0 + x1) / 2 + cw / 2, -h + (y0 + y1) / 2 + ch / 2],
    }
    for code, box in expected.items():
        got = _detect(f"code_type: {code} confidence_threshold: 0.85", loc=loc)  # only prior A, class 1
        assert got.shape == (1, 1, 1, 7), code
        np.testing.assert_allclose(got[0, 0, 0], [0, 1, 0.9, *box], rtol=1e-6, atol=1e-7, err_msg=code)


def test_detection_output_with_a_box_per_class(isolated_registry):
    """share_location false: loc holds a box per prior per class (prior-major), each class decoded from its own;
    the background class's boxes are not read."""
    loc = np.zeros((1, 4, 3, 4), np.float32)
    loc[0, D, 2] = 1  # class 2's box at D (its best) moves by the variances
    loc[0, A, 2] = 5  # class 2's box at A, which class 1 does not read
    loc[0, A, 0] = np.nan  # the background's
    got = _detect("share_location: false code_type: CORNER nms_param { top_k: 1 }", loc=loc.reshape(1, -1),
                  loc_classes=3)
    np.testing.assert_allclose(got, [[[[0, 1, 0.9, *PRIORS[A]], [0, 2, 0.7, *(PRIORS[D] + VARIANCES)]]]], rtol=1e-6)


def test_detection_output_checks_its_settings_and_bottoms(isolated_registry, caplog):
    forks.register_detection_output()

    def net(param: str, loc_channels: int = 16, prior_channels: int = 2):
        return caffejax.Net(input_layer(1, loc_channels, name="loc") + input_layer(1, 12, name="conf")
                            + input_layer(1, prior_channels, 16, name="prior")
                            + 'layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" '
                              f'bottom: "prior" top: "det" detection_output_param {{ {param} }} }}\n', caffejax.TEST)

    with pytest.raises(caffejax.SchemaError, match="Must specify num_classes"):
        net("")
    with pytest.raises(caffejax.SchemaError, match="share_location with background_label_id -1"):
        net("num_classes: 3 background_label_id: -1")
    with pytest.raises(caffejax.SchemaError, match="eta must be in"):
        net("num_classes: 3 nms_param { eta: 0 }")
    with pytest.raises(caffejax.UnsupportedError, match="visualize"):
        net("num_classes: 3 visualize: true")
    with pytest.raises(caffejax.ShapeError, match=r"Number of priors must match number of location predictions: 4 "
                                                  r"priors x 1 x 4 != 12 loc channels"):
        net("num_classes: 3", loc_channels=12)
    with pytest.raises(caffejax.ShapeError, match=r"the prior bottom must hold 4 boxes and then their variances, "
                                                  r"\(1, 2, 16\) as PriorBox makes it; got \(1, 1, 16\)"):
        net("num_classes: 3", prior_channels=1)
    with pytest.raises(caffejax.ParseError, match='"CodeType" has no value named "CENTRE"|CENTRE'):
        net("num_classes: 3 code_type: CENTRE")
    with caplog.at_level(logging.WARNING, logger="caffejax"):
        net('num_classes: 3 save_output_param { output_directory: "/results" label_map_file: "labels.prototxt" '
            'name_size_file: "sizes.txt" num_test_image: 10 resize_param { resize_mode: WARP height: 300 '
            'interp_mode: LINEAR interp_mode: AREA } }')
    assert "save_output_param is not supported; detections are not written to '/results'" in caplog.text


# ---- a small SSD head, against OpenCV ---------------------------------------------------------------------------

def _ssd_text(detection_param: str, share_location: bool) -> str:
    """An SSD head on one 16x16 feature map, as SSD's model files write it: loc and conf convolutions, Permute
    and Flatten, a softmax over classes, PriorBox, DetectionOutput."""
    loc_outputs = 3 * 4 * (1 if share_location else 3)
    return (input_layer(2, 3, 32, 32, name="data")
            + 'layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 8 '
              'kernel_size: 3 stride: 2 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }\n'
            + f'layer {{ name: "loc" type: "Convolution" bottom: "conv" top: "loc" convolution_param {{ num_output: '
              f'{loc_outputs} kernel_size: 3 pad: 1 weight_filler {{ type: "gaussian" std: 0.1 }} }} }}\n'
            + 'layer { name: "loc_perm" type: "Permute" bottom: "loc" top: "loc_perm" permute_param { order: 0 '
              'order: 2 order: 3 order: 1 } }\n'
            + 'layer { name: "loc_flat" type: "Flatten" bottom: "loc_perm" top: "loc_flat" }\n'
            + 'layer { name: "conf" type: "Convolution" bottom: "conv" top: "conf" convolution_param { num_output: 9 '
              'kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.05 } } }\n'
            + 'layer { name: "conf_perm" type: "Permute" bottom: "conf" top: "conf_perm" permute_param { order: 0 '
              'order: 2 order: 3 order: 1 } }\n'
            + 'layer { name: "conf_flat" type: "Flatten" bottom: "conf_perm" top: "conf_flat" }\n'
            + 'layer { name: "conf_reshape" type: "Reshape" bottom: "conf_flat" top: "conf_reshape" reshape_param { '
              'shape { dim: 0 dim: -1 dim: 3 } } }\n'
            + 'layer { name: "conf_softmax" type: "Softmax" bottom: "conf_reshape" top: "conf_softmax" softmax_param { '
              'axis: 2 } }\n'
            + 'layer { name: "conf_out" type: "Flatten" bottom: "conf_softmax" top: "conf_out" }\n'
            + 'layer { name: "prior" type: "PriorBox" bottom: "conv" bottom: "data" top: "prior" prior_box_param { '
              'min_size: 8 max_size: 16 aspect_ratio: 2 flip: false clip: false variance: 0.1 variance: 0.1 '
              'variance: 0.2 variance: 0.2 } }\n'
            + 'layer { name: "detection_out" type: "DetectionOutput" bottom: "loc_flat" bottom: "conf_out" '
              'bottom: "prior" top: "detection_out" detection_output_param { num_classes: 3 '
              f'share_location: {str(share_location).lower()} {detection_param} }} }}\n')


def _by_image_label_score(rows: np.ndarray) -> np.ndarray:
    rows = rows.reshape(-1, 7)
    return rows[np.lexsort((rows[:, 3], -rows[:, 2], rows[:, 1], rows[:, 0]))]


@pytest.mark.parametrize("share_location", [True, False])
@pytest.mark.parametrize("detection_param", [
    "background_label_id: 0 nms_param { nms_threshold: 0.45 top_k: 400 } code_type: CENTER_SIZE keep_top_k: 200 "
    "confidence_threshold: 0.01",
    "background_label_id: 0 nms_param { nms_threshold: 0.3 top_k: 20 } code_type: CENTER_SIZE keep_top_k: 15 "
    "confidence_threshold: 0.2",
    "background_label_id: 0 nms_param { nms_threshold: 0.5 } code_type: CORNER keep_top_k: 5000 "
    "confidence_threshold: 0.3",
    "background_label_id: 2 nms_param { nms_threshold: 0.5 top_k: 50 } code_type: CENTER_SIZE keep_top_k: 30 "
    "confidence_threshold: 0.3",
    # OpenCV's own field, in its face detector's deploy.prototxt: decoded boxes clipped to [0, 1]
    "background_label_id: 0 nms_param { nms_threshold: 0.45 top_k: 400 } code_type: CENTER_SIZE keep_top_k: 200 "
    "confidence_threshold: 0.2 clip: 1"])
def test_detection_output_matches_opencv(detection_param, share_location, isolated_registry, tmp_path):
    """OpenCV's DetectionOutput, another reading of SSD's layer, finds the same detections on a small SSD head
    with random weights. Compared as sets: past keep_top_k OpenCV orders the rows by score, where Caffe groups
    them by label (DetectionOutputLayer::Forward_cpu's std::map)."""
    cv2 = pytest.importorskip("cv2")
    forks.register_all()
    prototxt_path, weights = tmp_path / "ssd.prototxt", tmp_path / "ssd.caffemodel"
    prototxt_path.write_text(_ssd_text(detection_param, share_location))
    net = caffejax.Net(str(prototxt_path), caffejax.TEST)
    net.save(str(weights))
    images = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    ours = np.asarray(net.forward(data=images)["detection_out"])
    theirs_net = cv2.dnn.readNetFromCaffe(str(prototxt_path), str(weights))
    theirs_net.setInput(images)
    theirs = theirs_net.forward()
    theirs = theirs[:, :, theirs[0, 0, :, 2] > 0]  # OpenCV pads to keep_top_k rows per image
    assert ours.shape == theirs.shape and ours.shape[2] > 10
    np.testing.assert_allclose(_by_image_label_score(ours), _by_image_label_score(theirs), rtol=1e-5, atol=1e-5)


# ---- running after the program ------------------------------------------------------------------------------------

SSD_PARAM = ("background_label_id: 0 nms_param { nms_threshold: 0.45 top_k: 50 } code_type: CENTER_SIZE keep_top_k: 20 "
             "confidence_threshold: 0.3")


def test_detection_output_runs_on_the_host_after_every_kind_of_program(isolated_registry, tmp_path):
    """Its top takes the number of detections on every forward (Caffe reshapes it in Forward); compile_inference,
    a forward layer by layer and a solver's step end with it too."""
    forks.register_all()
    text = _ssd_text(SSD_PARAM, True)
    net = caffejax.Net(text, caffejax.TEST)
    assert net.blobs["detection_out"].shape == (1, 1, 1, 7)  # Reshape's placeholder, before any forward
    images = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    found = np.asarray(net.forward(data=images)["detection_out"])
    assert found.shape[2] > 10 and set(found[0, 0, :, 0]) == {0, 1}
    flat = np.asarray(net.forward(data=np.zeros_like(images))["detection_out"])
    assert flat.shape != found.shape and net.blobs["detection_out"].shape == flat.shape
    np.testing.assert_array_equal(caffejax.compile_inference(net)({"data": images})["detection_out"], found)
    np.testing.assert_array_equal(caffejax.compile_inference(net, passes=())({"data": images})["detection_out"],
                                  found)
    called = []
    net.after_forward(called.append)
    np.testing.assert_array_equal(net.forward(data=images)["detection_out"], found)
    assert called == list(range(len(net.layers)))

    # In a training net, each step's forward ends with it too.
    (tmp_path / "train.prototxt").write_text(
        text.replace(input_layer(2, 3, 32, 32, name="data"),
                     'layer { name: "data" type: "DummyData" top: "data" dummy_data_param { shape { dim: 2 dim: 3 '
                     'dim: 32 dim: 32 } data_filler { type: "gaussian" std: 1 } } }\n')
        + 'layer { name: "loss" type: "Reduction" bottom: "loc_flat" top: "loss" loss_weight: 1 }\n')
    (tmp_path / "solver.prototxt").write_text(f'net: "{tmp_path / "train.prototxt"}"\nbase_lr: 0.01\n'
                                             'lr_policy: "fixed"\nmax_iter: 5\nsnapshot_after_train: false\n'
                                             'test_iter: 1\ntest_interval: 100\ntest_initialization: false\n')
    solver = caffejax.SGDSolver(str(tmp_path / "solver.prototxt"))
    solver.step(1)
    stepped = np.array(solver.net.blobs["detection_out"].data)
    assert stepped.shape[2] > 1
    solver.net.forward()  # DummyData's gaussian draws anew: other detections, of their own count
    assert solver.net.blobs["detection_out"].shape[:2] == (1, 1)
    # Solver's test sums each output element over batches, as Caffe's: a batch's detections score as any output,
    # and a number of them that changes between batches is refused (summed_scores), where Caffe indexes past.
    assert len(solver.test()) == 1 + solver.test_nets[0].blobs["detection_out"].count
    rows = [("detection_out", 0.0, 1.0)] * 7
    with pytest.raises(caffejax.CaffejaxError, match=r"batch 1: the outputs changed size \(14 values, 7 before\)"):
        summed_scores(summed_scores(None, rows, 0), rows * 2, 1)


def test_detection_output_nms_without_the_overlap_matrix_keeps_the_same_boxes(isolated_registry, monkeypatch):
    """Past _NMS_MATRIX_MAX candidates (top_k unset, a low threshold) the overlaps are computed per kept box: the
    same detections."""
    forks.register_all()
    net = caffejax.Net(_ssd_text("background_label_id: 0 nms_param { nms_threshold: 0.45 } code_type: CENTER_SIZE "
                                 "keep_top_k: -1 confidence_threshold: 0.01", True), caffejax.TEST)
    images = np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32)
    with_matrix = np.asarray(net.forward(data=images)["detection_out"])
    monkeypatch.setattr(forks, "_NMS_MATRIX_MAX", 16)
    assert with_matrix.shape[2] > 100
    np.testing.assert_array_equal(net.forward(data=images)["detection_out"], with_matrix)


def test_detection_output_has_no_gradient_nor_traced_form(isolated_registry, tmp_path):
    """A compiled layer reading its top runs in a later program, it takes no loss_weight, its backward is Caffe's NOT_IMPLEMENTED (a
    force_backward reaching it is an error; without one the backward runs), export and batched calls refuse it
    by name."""
    forks.register_all()
    text = _ssd_text(SSD_PARAM, True)
    images = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    # A compiled layer reading its top runs after it, in its own program (Net.forward's and compile_inference's
    # stages); one program over both is refused by name.
    staged = caffejax.Net(text + 'layer { name: "relu" type: "ReLU" bottom: "detection_out" top: "r" }',
                          caffejax.TEST)
    out = staged.forward(data=images)
    np.testing.assert_array_equal(out["r"], np.maximum(staged.blobs["detection_out"].data, 0))
    np.testing.assert_array_equal(np.asarray(caffejax.compile_inference(staged)({"data": images})["r"]), out["r"])
    with pytest.raises(caffejax.UnsupportedError, match=r"layer 'relu' \(type ReLU\): reads the top of layer "
                                                        r"'detection_out' \(type DetectionOutput\)"):
        caffejax.compile_inference(staged, devices=1)
    with pytest.raises(caffejax.SchemaError, match="cannot carry a loss_weight"):
        caffejax.Net(text.replace('top: "detection_out"', 'top: "detection_out" loss_weight: 1'), caffejax.TEST)
    with pytest.raises(caffejax.GraphError, match="cannot run in place"):
        caffejax.Net(text.replace('top: "detection_out"', 'top: "loc_flat"'), caffejax.TEST)
    forced = caffejax.Net("force_backward: true\n" + text, caffejax.TEST)
    forced.forward(data=images)
    with pytest.raises(caffejax.UnsupportedError, match="has no backward"):
        forced.backward()
    net = caffejax.Net(text, caffejax.TEST)
    net.forward(data=images)
    net.backward()
    with pytest.raises(caffejax.UnsupportedError, match=r"bottoms \['loc_flat', 'conf_out', 'prior'\] as outputs"):
        export_stablehlo(net, str(tmp_path / "ssd.stablehlo"))
    with pytest.raises(caffejax.UnsupportedError, match="forward_all cannot join its top 'detection_out'"):
        net.forward_all(data=images)


def test_detection_output_in_time_and_debug_nans(isolated_registry, tmp_path, capsys):
    """caffejax time reports it among the layers (its host time) and ends the whole forward with it; debug_nans
    replays it and names it where its top is the first non-finite one (boxes whose exp overflowed)."""
    from caffejax.cli import main

    forks.register_all()
    (tmp_path / "ssd.prototxt").write_text(_ssd_text(SSD_PARAM, True))
    assert main(["time", "-model", str(tmp_path / "ssd.prototxt"), "-iterations", "2"]) == 0
    err = capsys.readouterr().err
    took = re.search(r"\] detection_out\tforward: ([0-9.e+-]+) ms\.$", err, re.M)
    assert took and float(took.group(1)) > 0, err[-3000:]
    assert re.search(r"\] detection_out\tbackward: 0 ms\.$", err, re.M)
    net = _detection_net("code_type: CENTER_SIZE confidence_threshold: 0.85")
    net.debug_nans = True
    loc = np.zeros((1, 16), np.float32)
    loc[0, 2] = 1000  # prior A's width: exp(0.2 * 1000) overflows
    with pytest.raises(caffejax.NumericalError, match="layer 'det'"):
        net.forward(loc=loc, conf=SCORES.reshape(1, -1), prior=_prior_blob())


def test_fork_params_declare_nested_messages_and_enums(isolated_registry):
    """A fork field may be of a message the fork declares, and of an enum of its own message or of that one."""
    mode = ForkEnum("Mode", (("FAST", 1), ("EXACT", 2)))
    fork = ForkParam("demo_param", "DemoParameter", 9101,
                     (ForkParamField("mode", "Mode", 1, default="EXACT"), ForkParamField("inner", "DemoInner", 2)),
                     enums=(mode,),
                     messages=(ForkMessage("DemoInner", (ForkParamField("kind", "Kind", 1, default="B"),),
                                           (ForkEnum("Kind", (("A", 1), ("B", 2))),)),))
    register_fork_param(fork)
    layer = caffejax.Net(input_layer(2) + 'layer { name: "s" type: "Silence" bottom: "x" demo_param { mode: FAST '
                                          'inner { kind: A } } }', caffejax.TEST).to_proto().layer[1]
    param = prototxt.fork_param(layer, "demo_param")
    assert (param.mode, param.inner.kind) == (1, 1)
    assert "demo_param {\n  mode: FAST\n  inner {\n    kind: A\n  }\n}" in prototxt.to_text(layer)
    defaults = prototxt.fork_param(caffejax.Net(input_layer(2) + 'layer { name: "s" type: "Silence" bottom: "x" }',
                                                caffejax.TEST).to_proto().layer[1], "demo_param")
    assert (defaults.mode, defaults.inner.kind) == (2, 2)
    for bad, message in (
            (ForkParam("bad_param", "BadParameter", 9102, (ForkParamField("m", "Mode", 1, default="SLOW"),),
                       enums=(mode,)), "default 'SLOW' is not a value of enum 'Mode'"),
            (ForkParam("bad_param", "BadParameter", 9102, (ForkParamField("m", "Nowhere", 1),)),
             "unknown type 'Nowhere'"),
            (ForkParam("bad_param", "BadParameter", 9102, (), messages=(ForkMessage("DemoInner", ()),)),
             "message name 'DemoInner' is taken"),
            (ForkParam("bad_param", "BadParameter", 9102, (), enums=(ForkEnum("E", (("X", 1), ("Y", 1))),)),
             "enum 'E' needs a valid name and distinct value names and numbers")):
        with pytest.raises(caffejax.SchemaError, match=message):
            register_fork_param(bad)
