"""Written-out shape rules (``LayerRule.top_shapes``) agree with abstract evaluation of the layer's forward.

Building a net uses a rule's ``top_shapes`` where it has one instead of tracing its forward. Each such rule is
checked here against ``jax.eval_shape`` of the forward on every layer of the published nets (at two batch
sizes) and on configurations Caffe rejects, where both must raise the same error.
"""

from __future__ import annotations

import pytest

import caffejax
from caffejax.errors import ShapeError
from caffejax.frontend.build import infer_top_shapes
from caffejax.lower.registry import TEST, get_rule, registered_types
from caffejax.proto import caffe_pb2
from google.protobuf import text_format
from conftest import BUNDLED, MODELS

NETS = {
    "lenet": BUNDLED / "lenet/lenet.prototxt",
    "alexnet": MODELS / "bvlc/models/bvlc_alexnet/deploy.prototxt",  # LRN across channels
    "cifar10_full": MODELS / "bvlc/examples/cifar10/cifar10_full.prototxt",  # LRN within channel
    "googlenet": MODELS / "bvlc/models/bvlc_googlenet/deploy.prototxt",
    "resnet50": MODELS / "resnet/ResNet-50-deploy.prototxt",
    "mobilenet_v2": MODELS / "mobilenet/mobilenet_v2_deploy.prototxt",
    "squeezenet": MODELS / "squeezenet/v1.1/deploy.prototxt",
    "fcn8s": MODELS / "fcn/voc-fcn8s/deploy.prototxt",  # Deconvolution, Crop
    "inception_v3": MODELS / "soeaver/deploy_inception-v3.prototxt",  # asymmetric kernels and pads
    "densenet121": MODELS / "densenet/DenseNet_121.prototxt",
    "mtcnn_det3": BUNDLED / "mtcnn/det3.prototxt",  # PReLU after convolutions and an InnerProduct
}
WITH_RULES = [t for t in registered_types() if get_rule(t).top_shapes is not None]


def test_the_common_layers_have_written_rules():
    assert {"Convolution", "Deconvolution", "Pooling", "ReLU", "Sigmoid", "TanH", "Dropout", "Split", "BatchNorm",
            "Scale", "Bias", "Eltwise", "InnerProduct", "Softmax", "Concat", "LRN", "Flatten",
            "Reshape", "PReLU", "AbsVal", "BNLL", "Clip", "ELU", "Exp", "Log", "Power", "Swish",
            "Threshold"} <= set(WITH_RULES)


def _both(layer_param, bottom_shapes, param_shapes, num_tops):
    rule = get_rule(layer_param.type)
    written = [tuple(s) for s in rule.top_shapes(layer_param, bottom_shapes, param_shapes, num_tops)]
    traced = infer_top_shapes(layer_param, rule, TEST, bottom_shapes, param_shapes, num_tops)
    return written, traced


@pytest.mark.parametrize("name", list(NETS))
def test_written_rules_match_the_traced_forward(name):
    net = caffejax.Net(str(NETS[name]), caffejax.TEST)
    data = net.inputs[0]
    checked = 0
    for batch in (1, 3):
        graph = net.graph_at({data: (batch,) + tuple(net.blobs[data].shape[1:])})
        for layer in graph.layers:
            if layer.is_input or get_rule(layer.type).top_shapes is None:
                continue
            bottoms = [graph.value_shapes[v] for v in layer.bottom_values]
            params = [slot.shape for slot in layer.params]
            written, traced = _both(layer.proto, bottoms, params, len(layer.tops))
            assert written == traced, (layer.name, bottoms)
            assert written == [graph.value_shapes[v] for v in layer.top_values]
            checked += 1
    assert checked > 0


def _layer(text: str) -> caffe_pb2.LayerParameter:
    return text_format.Parse(text, caffe_pb2.LayerParameter())


# Configurations of the written rules the published nets above do not reach.
GOOD = [
    ('name: "f" type: "Flatten"', [(2, 3, 4, 5)], [], 1),
    ('name: "f" type: "Flatten" flatten_param { axis: 2 end_axis: -2 }', [(2, 3, 4, 5, 6)], [], 1),
    ('name: "f" type: "Flatten" flatten_param { axis: -1 }', [(2, 3)], [], 1),
    ('name: "f" type: "Flatten" flatten_param { axis: 2 end_axis: 1 }', [(2, 3, 4)], [], 1),  # a new axis of 1
    ('name: "r" type: "Reshape" reshape_param { shape { dim: 0 dim: -1 dim: 2 } }', [(2, 3, 4)], [], 1),
    ('name: "r" type: "Reshape" reshape_param { shape { dim: 6 } axis: 1 num_axes: 2 }', [(2, 2, 3, 5)], [], 1),
    ('name: "r" type: "Reshape" reshape_param { shape { dim: 1 } axis: -1 }', [(2, 3)], [], 1),
    ('name: "b" type: "Bias"', [(2, 3, 4)], [(3,)], 1),
    ('name: "b" type: "Bias" bias_param { axis: 0 }', [(2, 3, 4), (2, 3)], [], 1),
    ('name: "s" type: "Scale" scale_param { axis: 2 num_axes: 1 bias_term: true }', [(2, 3, 4)], [(4,), (4,)], 1),
    ('name: "s" type: "Scale"', [(2, 3, 4), ()], [], 1),        # a scalar bottom scales from axis 0
    ('name: "s" type: "Scale" scale_param { bias_term: true }', [(2, 3, 4), (3, 4)], [(3, 4)], 1),
    ('name: "e" type: "Eltwise" eltwise_param { operation: PROD }', [(2, 3), (2, 3), (2, 3)], [], 1),
    ('name: "e" type: "Eltwise" eltwise_param { operation: MAX }', [(2, 3), (2, 3)], [], 1),
    ('name: "e" type: "Eltwise" eltwise_param { coeff: 1 coeff: -1 }', [(2, 3), (2, 3)], [], 1),
    ('name: "i" type: "InnerProduct" inner_product_param { num_output: 4 axis: 2 transpose: true }',
     [(2, 3, 5, 6)], [(30, 4), (4,)], 1),
    ('name: "i" type: "InnerProduct" inner_product_param { num_output: 4 bias_term: false axis: -1 }', [(2, 3, 5)],
     [(4, 5)], 1),
    ('name: "c" type: "Concat" concat_param { concat_dim: 0 }', [(2, 3), (4, 3)], [], 1),
    ('name: "c" type: "Concat" concat_param { axis: -1 }', [(2, 3), (2, 1), (2, 5)], [], 1),
    ('name: "s" type: "Softmax" softmax_param { axis: -1 }', [(2, 3, 4)], [], 1),
    ('name: "n" type: "BatchNorm"', [(4, 3)], [(3,), (3,), (1,)], 1),
    ('name: "p" type: "PReLU" prelu_param { channel_shared: true }', [(2, 3, 4)], [()], 1),
    ('name: "p" type: "PReLU"', [(2, 3)], [(3,)], 1),
    ('name: "p" type: "PReLU"', [(2, 6, 2)], [(2, 3)], 1),  # a shared blob of the right count
    ('name: "a" type: "AbsVal"', [(2, 3, 4)], [], 1),
    ('name: "b" type: "BNLL"', [()], [], 1),
    ('name: "c" type: "Clip" clip_param { min: -1 max: 1 }', [(5,)], [], 1),
    ('name: "e" type: "ELU" elu_param { alpha: 0.5 }', [(2, 3)], [], 1),
    ('name: "e" type: "Exp" exp_param { base: 2 scale: 3 shift: 1 }', [(2, 3)], [], 1),
    ('name: "l" type: "Log" log_param { base: -1 shift: 1 }', [(2, 3)], [], 1),
    ('name: "p" type: "Power" power_param { power: 0 }', [(2, 3)], [], 1),
    ('name: "p" type: "Power" power_param { power: 2 scale: 3 }', [(2, 3)], [], 1),
    ('name: "s" type: "Swish"', [(2, 3)], [], 1),
    ('name: "t" type: "Threshold"', [(2, 3)], [], 1),
]


@pytest.mark.parametrize("text, bottoms, params, num_tops", GOOD)
def test_written_rules_match_the_traced_forward_on_other_configurations(text, bottoms, params, num_tops):
    written, traced = _both(_layer(text), bottoms, params, num_tops)
    assert written == traced


BAD = [
    ('name: "c" type: "Convolution" convolution_param { num_output: 4 kernel_size: 9 }', [(1, 3, 5, 5)],
     [(4, 3, 9, 9), (4,)], 1),                                   # kernel larger than the input
    ('name: "c" type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 group: 2 }', [(1, 3, 5, 5)],
     [(4, 1, 3, 3), (4,)], 1),                                   # channels not divisible by group
    ('name: "c" type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 }', [(1, 3, 5, 5)],
     [(4, 2, 3, 3), (4,)], 1),                                   # wrong learnable blob
    ('name: "c" type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 }',
     [(1, 3, 5, 5), (1, 3, 6, 6)], [(4, 3, 3, 3), (4,)], 2),     # bottoms of different shapes
    ('name: "c" type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 }', [(1, 3, 5, 5)],
     [(4, 3, 3, 3), (4,)], 2),                                   # tops != bottoms
    ('name: "d" type: "Deconvolution" convolution_param { num_output: 4 kernel_size: 1 pad: 2 }',
     [(1, 3, 2, 2)], [(3, 4, 1, 1), (4,)], 1),                   # empty output
    ('name: "p" type: "Pooling" pooling_param { pool: AVE kernel_size: 2 }', [(1, 3, 5, 5)], [], 2),  # mask top
    ('name: "p" type: "Pooling" pooling_param { kernel_size: 7 }', [(1, 3, 5, 5)], [], 1),
    ('name: "p" type: "Pooling" pooling_param { kernel_size: 3 pad: 3 }', [(1, 3, 5, 5)], [], 1),
    ('name: "p" type: "Pooling" pooling_param { kernel_size: 2 }', [(3, 5, 5)], [], 1),
    ('name: "r" type: "Dropout" dropout_param { dropout_ratio: 1.0 }', [(2, 3)], [], 1),
    ('name: "n" type: "BatchNorm"', [(4,)], [(1,), (1,), (1,)], 1),              # no channel axis
    ('name: "n" type: "BatchNorm"', [(4, 3)], [(4,), (4,), (1,)], 1),            # blobs of other channels
    ('name: "s" type: "Scale"', [(2, 3, 4)], [(4,)], 1),                         # scale over the wrong axis
    ('name: "s" type: "Scale" scale_param { axis: 3 }', [(2, 3, 4)], [(4,)], 1),  # axis out of range
    ('name: "s" type: "Scale" scale_param { bias_term: true }', [(2, 3, 4)], [(3,), (4,)], 1),  # bias misfits
    ('name: "b" type: "Bias" bias_param { axis: 1 }', [(2, 3, 4), (3, 5)], [], 1),
    ('name: "e" type: "Eltwise"', [(2, 3), (2, 4)], [], 1),                      # bottoms differ
    ('name: "e" type: "Eltwise" eltwise_param { coeff: 1 }', [(2, 3), (2, 3)], [], 1),  # one coeff, 2 bottoms
    ('name: "e" type: "Eltwise" eltwise_param { operation: PROD coeff: 1 coeff: 2 }', [(2, 3), (2, 3)], [], 1),
    ('name: "i" type: "InnerProduct" inner_product_param { num_output: 4 }', [(2, 3, 5)], [(4, 14), (4,)], 1),
    ('name: "i" type: "InnerProduct" inner_product_param { num_output: 4 axis: 3 }', [(2, 3, 5)],
     [(4, 1), (4,)], 1),
    ('name: "i" type: "InnerProduct" inner_product_param { num_output: 4 }', [(2, 3)], [(4, 3), (5,)], 1),
    ('name: "i" type: "InnerProduct" inner_product_param { num_output: 4 }', [(2, 3)], [(4, 3, 1)], 1),
    ('name: "s" type: "Softmax" softmax_param { axis: 2 }', [(2, 3)], [], 1),
    ('name: "c" type: "Concat"', [(2, 3, 4), (2, 5, 5)], [], 1),                 # differ off the concat axis
    ('name: "c" type: "Concat"', [(2, 3, 4), (2, 5)], [], 1),                    # differ in rank
    ('name: "c" type: "Concat" concat_param { axis: 1 concat_dim: 1 }', [(2, 3), (2, 3)], [], 1),
    ('name: "c" type: "Concat" concat_param { concat_dim: 2 }', [(2, 3), (2, 3)], [], 1),
    ('name: "l" type: "LRN" lrn_param { local_size: 4 }', [(1, 3, 5, 5)], [], 1),  # even window
    ('name: "l" type: "LRN"', [(3, 5, 5)], [], 1),                               # not 4-D
    ('name: "f" type: "Flatten" flatten_param { axis: 2 end_axis: 0 }', [(2, 3, 4)], [], 1),
    ('name: "f" type: "Flatten" flatten_param { axis: 3 }', [(2, 3, 4)], [], 1),
    ('name: "r" type: "Reshape" reshape_param { shape { dim: -1 dim: -1 } }', [(2, 3)], [], 1),
    ('name: "r" type: "Reshape" reshape_param { shape { dim: 5 } }', [(2, 3)], [], 1),
    ('name: "r" type: "Reshape" reshape_param { shape { dim: 0 dim: 0 dim: 0 } }', [(2, 3)], [], 1),
    ('name: "r" type: "Reshape" reshape_param { shape { dim: -1 dim: 4 } }', [(2, 3)], [], 1),
    ('name: "p" type: "PReLU"', [(2, 3, 4)], [(4,)], 1),                       # a slope per other channels
    ('name: "p" type: "PReLU" prelu_param { channel_shared: true }', [(2, 3)], [(3,)], 1),
    ('name: "p" type: "PReLU"', [(6,)], [(1,)], 1),                              # no channel axis
    ('name: "e" type: "Exp" exp_param { base: 0 }', [(2, 3)], [], 1),
    ('name: "l" type: "Log" log_param { base: -2 }', [(2, 3)], [], 1),
    ('name: "l" type: "Log" log_param { base: 1 }', [(2, 3)], [], 1),           # 1 / ln(base) infinite
]


@pytest.mark.parametrize("text, bottoms, params, num_tops", BAD)
def test_written_rules_raise_what_the_forward_raises(text, bottoms, params, num_tops):
    lp = _layer(text)
    rule = get_rule(lp.type)
    with pytest.raises(ShapeError) as written:
        rule.top_shapes(lp, bottoms, params, num_tops)
    with pytest.raises(ShapeError) as traced:
        infer_top_shapes(lp, rule, TEST, bottoms, params, num_tops)
    assert str(written.value) == str(traced.value)
