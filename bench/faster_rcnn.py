"""Faster R-CNN's test net (py-faster-rcnn's VGG16 end2end, with its Python ProposalLayer written as OpenCV's
Proposal layer) at one image: caffejax's Net.forward and compile_inference, each run in stages around the
proposals, against OpenCV DNN on the same prototxt and weights (random, MSRA-filled), in alternating blocks of
the same run.

    python -m bench.faster_rcnn                      # 600 x 800, py-faster-rcnn's test scale
    python -m bench.faster_rcnn --height 375 --width 500 --repeats 5 --json out.json
    python -m bench.faster_rcnn --net r-fcn          # py-R-FCN's ResNet-50 R-FCN (PSROIPooling), the same way

Prints the median ms of each, their ratio, the stages' share of caffejax's forward (the layers before the
proposals, the proposals on the host, the layers after them), the first forward's seconds (compiles
included), and how many of caffejax's ROIs OpenCV found too, with their class scores. A benchmark, never a
test.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import numpy as np

VGG16 = [(64, 2), (128, 2), (256, 3), (512, 3), (512, 3)]  # channels, convolutions per block


def vgg16_faster_rcnn(height: int, width: int, classes: int = 21) -> str:
    """The test.prototxt of py-faster-rcnn's models/pascal_voc/VGG16/faster_rcnn_end2end, its Python
    ProposalLayer as OpenCV's Proposal (feat_stride 16, TEST's 6000/300/0.7)."""
    lines = ['name: "VGG_ILSVRC_16_layers"', 'input: "data"',
             f"input_shape {{ dim: 1 dim: 3 dim: {height} dim: {width} }}", 'input: "im_info"',
             "input_shape { dim: 1 dim: 3 }"]
    bottom = "data"
    msra = 'weight_filler { type: "msra" }'
    for block, (channels, convs) in enumerate(VGG16, 1):
        for i in range(1, convs + 1):
            name = f"conv{block}_{i}"
            lines.append(f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{name}" '
                         f'convolution_param {{ num_output: {channels} pad: 1 kernel_size: 3 {msra} }} }}')
            lines.append(f'layer {{ name: "relu{block}_{i}" type: "ReLU" bottom: "{name}" top: "{name}" }}')
            bottom = name
        if block < 5:
            lines.append(f'layer {{ name: "pool{block}" type: "Pooling" bottom: "{bottom}" top: "pool{block}" '
                         'pooling_param { pool: MAX kernel_size: 2 stride: 2 } }')
            bottom = f"pool{block}"
    lines += [
        'layer { name: "rpn_conv/3x3" type: "Convolution" bottom: "conv5_3" top: "rpn/output" '
        f'convolution_param {{ num_output: 512 kernel_size: 3 pad: 1 stride: 1 {msra} }} }}',
        'layer { name: "rpn_relu/3x3" type: "ReLU" bottom: "rpn/output" top: "rpn/output" }',
        'layer { name: "rpn_cls_score" type: "Convolution" bottom: "rpn/output" top: "rpn_cls_score" '
        'convolution_param { num_output: 18 kernel_size: 1 pad: 0 stride: 1 weight_filler { type: "gaussian" '
        'std: 0.01 } } }',
        'layer { name: "rpn_bbox_pred" type: "Convolution" bottom: "rpn/output" top: "rpn_bbox_pred" '
        'convolution_param { num_output: 36 kernel_size: 1 pad: 0 stride: 1 weight_filler { type: "gaussian" '
        'std: 0.001 } } }',
        'layer { bottom: "rpn_cls_score" top: "rpn_cls_score_reshape" name: "rpn_cls_score_reshape" '
        'type: "Reshape" reshape_param { shape { dim: 0 dim: 2 dim: -1 dim: 0 } } }',
        'layer { name: "rpn_cls_prob" type: "Softmax" bottom: "rpn_cls_score_reshape" top: "rpn_cls_prob" }',
        'layer { name: "rpn_cls_prob_reshape" type: "Reshape" bottom: "rpn_cls_prob" top: "rpn_cls_prob_reshape" '
        'reshape_param { shape { dim: 0 dim: 18 dim: -1 dim: 0 } } }',
        'layer { name: "proposal" type: "Proposal" bottom: "rpn_cls_prob_reshape" bottom: "rpn_bbox_pred" '
        'bottom: "im_info" top: "rois" proposal_param { ratio: 0.5 ratio: 1 ratio: 2 scale: 8 scale: 16 '
        'scale: 32 feat_stride: 16 min_size: 0 } }',  # OpenCV ignores min_size: 0 makes both keep the same
        'layer { name: "roi_pool5" type: "ROIPooling" bottom: "conv5_3" bottom: "rois" top: "pool5" '
        'roi_pooling_param { pooled_w: 7 pooled_h: 7 spatial_scale: 0.0625 } }',
        'layer { name: "fc6" type: "InnerProduct" bottom: "pool5" top: "fc6" '
        'inner_product_param { num_output: 4096 weight_filler { type: "gaussian" std: 0.005 } } }',
        'layer { name: "relu6" type: "ReLU" bottom: "fc6" top: "fc6" }',
        'layer { name: "drop6" type: "Dropout" bottom: "fc6" top: "fc6" dropout_param { dropout_ratio: 0.5 } }',
        'layer { name: "fc7" type: "InnerProduct" bottom: "fc6" top: "fc7" '
        'inner_product_param { num_output: 4096 weight_filler { type: "gaussian" std: 0.005 } } }',
        'layer { name: "relu7" type: "ReLU" bottom: "fc7" top: "fc7" }',
        'layer { name: "drop7" type: "Dropout" bottom: "fc7" top: "fc7" dropout_param { dropout_ratio: 0.5 } }',
        f'layer {{ name: "cls_score" type: "InnerProduct" bottom: "fc7" top: "cls_score" '
        f'inner_product_param {{ num_output: {classes} weight_filler {{ type: "gaussian" std: 0.01 }} }} }}',
        f'layer {{ name: "bbox_pred" type: "InnerProduct" bottom: "fc7" top: "bbox_pred" '
        f'inner_product_param {{ num_output: {4 * classes} weight_filler {{ type: "gaussian" std: 0.001 }} }} }}',
        'layer { name: "cls_prob" type: "Softmax" bottom: "cls_score" top: "cls_prob" }',
    ]
    return "\n".join(lines) + "\n"


def resnet50_r_fcn(height: int, width: int, classes: int = 21) -> str:
    """py-R-FCN's ResNet-50 class-agnostic test net (models/pascal_voc/ResNet-50/rfcn_end2end): ResNet-50 to
    res4f (stride 16), the RPN and its proposals (as OpenCV's Proposal layer), res5 on the whole map at stride
    16 with its 3 x 3 convolutions dilated by 2, conv_new_1, the position-sensitive score maps (7 x 7 bins)
    pooled per ROI (PSROIPooling) and averaged."""
    from bench.nets import MODELS

    text = (MODELS / "resnet/ResNet-50-deploy.prototxt").read_text()
    text = text[:text.rindex("layer", 0, text.index('name: "pool5"'))]  # no pool5, fc1000, prob
    res5 = text.index("layer", text.rindex("layer", 0, text.index('name: "res5a_branch1"')))
    body, tail = text[:res5], text[res5:]
    tail = tail.replace("stride: 2", "stride: 1")
    tail = tail.replace("kernel_size: 3\n\t\tpad: 1", "kernel_size: 3\n\t\tpad: 2\n\t\tdilation: 2")
    header, body = body.split("layer", 1)
    msra = 'weight_filler { type: "msra" }'
    small = 'weight_filler { type: "gaussian" std: 0.0005 }'
    lines = ['name: "ResNet-50-R-FCN"', 'input: "data"', f"input_shape {{ dim: 1 dim: 3 dim: {height} dim: {width} }}",
             'input: "im_info"', "input_shape { dim: 1 dim: 3 }", "layer" + body,
             # Small fillers after the body: random ResNet-50 activations reach the hundreds, which would
             # saturate the softmaxes (scores of 0 and 1, ties everywhere).
             'layer { name: "rpn_conv/3x3" type: "Convolution" bottom: "res4f" top: "rpn/output" '
             f'convolution_param {{ num_output: 512 kernel_size: 3 pad: 1 stride: 1 {small} }} }}',
             'layer { name: "rpn_relu/3x3" type: "ReLU" bottom: "rpn/output" top: "rpn/output" }',
             'layer { name: "rpn_cls_score" type: "Convolution" bottom: "rpn/output" top: "rpn_cls_score" '
             'convolution_param { num_output: 18 kernel_size: 1 weight_filler { type: "gaussian" std: 0.01 } } }',
             'layer { name: "rpn_bbox_pred" type: "Convolution" bottom: "rpn/output" top: "rpn_bbox_pred" '
             'convolution_param { num_output: 36 kernel_size: 1 weight_filler { type: "gaussian" std: 0.001 } } }',
             'layer { bottom: "rpn_cls_score" top: "rpn_cls_score_reshape" name: "rpn_cls_score_reshape" '
             'type: "Reshape" reshape_param { shape { dim: 0 dim: 2 dim: -1 dim: 0 } } }',
             'layer { name: "rpn_cls_prob" type: "Softmax" bottom: "rpn_cls_score_reshape" top: "rpn_cls_prob" }',
             'layer { name: "rpn_cls_prob_reshape" type: "Reshape" bottom: "rpn_cls_prob" '
             'top: "rpn_cls_prob_reshape" reshape_param { shape { dim: 0 dim: 18 dim: -1 dim: 0 } } }',
             'layer { name: "proposal" type: "Proposal" bottom: "rpn_cls_prob_reshape" bottom: "rpn_bbox_pred" '
             'bottom: "im_info" top: "rois" proposal_param { ratio: 0.5 ratio: 1 ratio: 2 scale: 8 scale: 16 '
             'scale: 32 feat_stride: 16 min_size: 0 } }',
             tail,
             'layer { name: "conv_new_1" type: "Convolution" bottom: "res5c" top: "conv_new_1" '
             f'convolution_param {{ num_output: 1024 kernel_size: 1 {msra} }} }}',
             'layer { name: "conv_new_1_relu" type: "ReLU" bottom: "conv_new_1" top: "conv_new_1" }',
             'layer { name: "rfcn_cls" type: "Convolution" bottom: "conv_new_1" top: "rfcn_cls" '
             f'convolution_param {{ num_output: {classes * 49} kernel_size: 1 {small} }} }}',
             'layer { name: "rfcn_bbox" type: "Convolution" bottom: "conv_new_1" top: "rfcn_bbox" '
             f'convolution_param {{ num_output: {8 * 49} kernel_size: 1 {small} }} }}',
             'layer { bottom: "rfcn_cls" bottom: "rois" top: "psroipooled_cls_rois" name: "psroipooled_cls_rois" '
             f'type: "PSROIPooling" psroi_pooling_param {{ spatial_scale: 0.0625 output_dim: {classes} '
             'group_size: 7 } }',
             'layer { bottom: "psroipooled_cls_rois" top: "cls_score" name: "ave_cls_score_rois" type: "Pooling" '
             'pooling_param { pool: AVE kernel_size: 7 stride: 7 } }',
             'layer { bottom: "rfcn_bbox" bottom: "rois" top: "psroipooled_loc_rois" name: "psroipooled_loc_rois" '
             'type: "PSROIPooling" psroi_pooling_param { spatial_scale: 0.0625 output_dim: 8 group_size: 7 } }',
             'layer { bottom: "psroipooled_loc_rois" top: "bbox_pred_pre" name: "ave_bbox_pred_rois" '
             'type: "Pooling" pooling_param { pool: AVE kernel_size: 7 stride: 7 } }',
             'layer { name: "cls_prob_pre" type: "Softmax" bottom: "cls_score" top: "cls_prob_pre" }',
             'layer { name: "cls_prob_reshape" type: "Reshape" bottom: "cls_prob_pre" top: "cls_prob" '
             f'reshape_param {{ shape {{ dim: -1 dim: {classes} }} }} }}',
             'layer { name: "bbox_pred_reshape" type: "Reshape" bottom: "bbox_pred_pre" top: "bbox_pred" '
             'reshape_param { shape { dim: -1 dim: 8 } } }']
    return "\n".join(lines) + "\n"


def _random_trained_weights(net, rng) -> None:
    """Weights a trained net could have where the prototxt gives no filler (ResNet-50's deploy convolutions,
    which Caffe's default filler leaves at 0): MSRA-random convolutions, BatchNorm's statistics mean 0,
    variance 1 and factor 1 (a fresh net's zero variance would scale every layer by 1 / sqrt(eps)), Scale's
    gamma 1 and beta 0."""
    for name, layer in zip(net._layer_names, net.layers):
        blobs = net.params.get(name, [])
        if layer.type == "BatchNorm":
            mean, variance, factor = blobs
            mean.data[...], variance.data[...], factor.data[...] = 0, 1, 1
        elif layer.type == "Scale":
            blobs[0].data[...] = 1
            if len(blobs) > 1:
                blobs[1].data[...] = 0
        elif layer.type == "Convolution" and not blobs[0].data.any():
            fan_in = np.prod(blobs[0].data.shape[1:])
            blobs[0].data[...] = rng.standard_normal(blobs[0].data.shape) * np.sqrt(2 / fan_in)


def _agreement(rois: np.ndarray, scores: np.ndarray, their_rois: np.ndarray, their_scores: np.ndarray):
    """The share of ``rois`` that OpenCV found too (a row of ``their_rois`` within 0.5 px), and the largest
    difference of the class scores of those. Not row by row: the two sum the convolutions in different orders,
    and proposals of nearly equal scores may swap places in the NMS."""
    if not len(rois):
        return 1.0, 0.0
    distance = np.abs(rois[:, None, 1:] - their_rois[None, :, 1:]).max(-1)
    nearest = distance.argmin(1)
    found = distance[np.arange(len(rois)), nearest] < 0.5
    difference = np.abs(scores[found] - their_scores[nearest[found]]).max() if found.any() else float("nan")
    return float(found.mean()), float(difference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--net", choices=("vgg16", "r-fcn"), default="vgg16",
                        help="py-faster-rcnn's VGG16 Faster R-CNN or py-R-FCN's ResNet-50 R-FCN")
    parser.add_argument("--height", type=int, default=600)
    parser.add_argument("--width", type=int, default=800)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    import cv2
    import jax

    import caffejax
    from bench.measure import timed_alternating
    from caffejax.lower import forks

    forks.register_all()
    text = (vgg16_faster_rcnn if args.net == "vgg16" else resnet50_r_fcn)(args.height, args.width)
    net = caffejax.Net(text, caffejax.TEST)
    _random_trained_weights(net, np.random.default_rng(1))
    rng = np.random.default_rng(0)
    feed = {"data": rng.standard_normal((1, 3, args.height, args.width)).astype(np.float32),
            "im_info": np.float32([[args.height, args.width, 1.0]])}
    with tempfile.TemporaryDirectory() as folder:
        prototxt, weights = pathlib.Path(folder) / "test.prototxt", pathlib.Path(folder) / "vgg16.caffemodel"
        prototxt.write_text(text)
        net.save(str(weights))
        reference = cv2.dnn.readNetFromCaffe(str(prototxt), str(weights))

    began = time.perf_counter()
    scores = net.forward(**feed)["cls_prob"].copy()
    first_s = time.perf_counter() - began

    def opencv():
        for name, array in feed.items():
            reference.setInput(array, name)
        return reference.forward(["proposal", "cls_prob" if args.net == "vgg16" else "cls_prob_reshape"])

    rois, want = opencv()
    found = len(scores)
    matched, score_diff = _agreement(net.blobs["rois"].data, scores, rois.reshape(-1, 5),
                                     want.reshape(-1, scores.shape[1]))
    infer = caffejax.compile_inference(net)  # the inference passes in each stage's program
    served = np.asarray(infer(feed)["cls_prob"])
    inference_difference = float(np.abs(served - scores).max()) if served.shape == scores.shape else float("inf")
    times = timed_alternating({"caffejax": lambda: net.forward(**feed)["cls_prob"],
                               "compile_inference": lambda: jax.block_until_ready(infer(feed)["cls_prob"]),
                               "opencv": opencv}, args.repeats, rounds=min(args.repeats, 3), warmup=1)
    proposal = list(net._layer_names).index("proposal")
    last = len(net.layers) - 1
    stages = timed_alternating({
        "before the proposals": lambda: jax.block_until_ready(net._forward(0, proposal - 1)),
        "proposals (host)": lambda: net._forward(proposal, proposal),
        "after the proposals": lambda: net._forward(proposal + 1, last)}, args.repeats, rounds=1, warmup=1)
    result = {"net": args.net, "image": [args.height, args.width], "rois": found, "first_forward_s": first_s,
              "caffejax_ms": times["caffejax"]["median_ms"], "opencv_ms": times["opencv"]["median_ms"],
              "ratio": times["caffejax"]["median_ms"] / times["opencv"]["median_ms"],
              "compile_inference_ms": times["compile_inference"]["median_ms"],
              "compile_inference_ratio": times["compile_inference"]["median_ms"] / times["opencv"]["median_ms"],
              "compile_inference_max_difference": inference_difference,
              "stages_ms": {name: t["median_ms"] for name, t in stages.items()}, "rois_in_opencv": matched,
              "max_score_difference": score_diff, "compile_count": net.compile_count}
    print(f"{'Faster R-CNN VGG16' if args.net == 'vgg16' else 'R-FCN ResNet-50'} test net, image {args.height} x {args.width}, {found} ROIs; {matched:.1%} of them "
          f"among OpenCV's (within 0.5 px), class scores of those within {score_diff:.1e}")
    print(f"  caffejax {result['caffejax_ms']:.0f} ms, OpenCV {result['opencv_ms']:.0f} ms, "
          f"ratio {result['ratio']:.2f}; first forward {first_s:.1f} s, {net.compile_count} programs")
    print(f"  compile_inference {result['compile_inference_ms']:.0f} ms, ratio "
          f"{result['compile_inference_ratio']:.2f}, its class scores within {inference_difference:.1e} of "
          "Net.forward's")
    for name, ms in result["stages_ms"].items():
        print(f"  {name}: {ms:.1f} ms")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
