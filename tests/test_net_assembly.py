"""Net assembly (build_graph), following BVLC Caffe's src/caffe/test/test_net.cpp and net.cpp's Init.

The nets of the backward-need tests are Caffe's test strings (InitTinyNet, InitTinyNetEuclidean,
InitTrickyNet, InitSkipPropNet, InitForcePropNet; fillers dropped where they do not matter), and the expected
flags are Caffe's. Learnable-blob shapes follow the LayerSetUp code cited in CAFFE_SEMANTICS.md §1; the output
sizes were computed by hand from the formulas in the layer sources (shown next to each case).
"""

from __future__ import annotations

import numpy as np
import pytest

import caffejax
from caffejax.errors import CaffejaxError, GraphError, SchemaError, ShapeError
from caffejax.frontend import build_graph, load_net_param
from caffejax.frontend.build import AUTOMATIC_TOP
from caffejax.proto import caffe_pb2
from conftest import MODELS

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST


def graph(text: str, phase: int = TRAIN, **kwargs):
    return build_graph(load_net_param(text), phase, **kwargs)


def bottom_need_backward(g) -> list[list[bool]]:
    return [list(layer.bottom_need_backward) for layer in g.layers]


def layer_need_backward(g) -> dict[str, bool]:
    return {layer.name: layer.need_backward for layer in g.layers}


# ---- Caffe's test nets ----------------------------------------------------------------------------------------

SHAPED_DATA = """
    layer {
      name: 'data' type: 'DummyData'
      dummy_data_param {
        shape { dim: 5 dim: 2 dim: 3 dim: 4 } data_filler { type: 'gaussian' std: 0.01 }
        shape { dim: 5 } data_filler { type: 'constant' value: 0 }
      }
      top: 'data' top: 'label'
    }
"""
LEGACY_DATA = """
    layer {
      name: 'data' type: 'DummyData'
      dummy_data_param {
        num: 5 channels: 2 height: 3 width: 4 num: 5 channels: 1 height: 1 width: 1
        data_filler { type: 'gaussian' std: 0.01 }
      }
      top: 'data' top: 'label'
    }
"""


def inner_product(name: str, bottom: str, top: str, num_output: int, params: bool = True) -> str:
    specs = "param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }" if params else ""
    return f"""
        layer {{
          name: '{name}' type: 'InnerProduct'
          inner_product_param {{ num_output: {num_output} weight_filler {{ type: 'gaussian' std: 0.01 }} }}
          {specs} bottom: '{bottom}' top: '{top}'
        }}
    """


def tiny_net(force_backward: bool = False) -> str:
    return ("name: 'TinyTestNetwork' " + SHAPED_DATA + inner_product("innerproduct", "data", "innerproduct", 1000)
            + "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'innerproduct' bottom: 'label' top: 'top_loss' }"
            + (" force_backward: true" if force_backward else ""))


def tiny_net_euclidean(force_backward: bool = False) -> str:
    return ("name: 'TinyTestEuclidLossNetwork' " + LEGACY_DATA
            + inner_product("innerproduct", "data", "innerproduct", 1)
            + "layer { name: 'loss' type: 'EuclideanLoss' bottom: 'innerproduct' bottom: 'label' }"
            + (" force_backward: true" if force_backward else ""))


def tricky_net() -> str:
    # Two layers named 'innerproduct' (allowed); the label goes through an InnerProduct into the loss.
    return ("name: 'TrickyTestNetwork' " + LEGACY_DATA
            + inner_product("innerproduct", "data", "transformed_data", 1000)
            + inner_product("innerproduct", "label", "transformed_label", 1)
            + "layer { name: 'loss' type: 'SoftmaxWithLoss' "
              "        bottom: 'transformed_data' bottom: 'transformed_label' }")


def skip_prop_net(skip: bool) -> str:
    propagate_down = "propagate_down: true propagate_down: false" if skip else \
        "propagate_down: true propagate_down: true"
    return ("name: 'SkipPropTestNetwork' " + SHAPED_DATA
            + "layer { name: 'silence' bottom: 'label' type: 'Silence' }"
            + inner_product("innerproduct", "data", "innerproduct", 1)
            + inner_product("ip_fake_labels", "data", "fake_labels", 1, params=False)
            + "layer { name: 'argmax' bottom: 'fake_labels' top: 'label_argmax' type: 'ArgMax' }"
            + f"""layer {{ name: 'loss' bottom: 'innerproduct' bottom: 'label_argmax' {propagate_down}
                          top: 'cross_entropy_loss' type: 'SigmoidCrossEntropyLoss' loss_weight: 0.1 }}""")


def force_prop_net(force: bool) -> str:
    return ("name: 'ForcePropTestNetwork' " + SHAPED_DATA
            + f"""layer {{ name: 'innerproduct' type: 'InnerProduct' inner_product_param {{ num_output: 1 }}
                          bottom: 'data' top: 'innerproduct' {'propagate_down: true' if force else ''} }}"""
            + "layer { name: 'loss' bottom: 'innerproduct' bottom: 'label' top: 'cross_entropy_loss' "
              "        type: 'SigmoidCrossEntropyLoss' }")


# ---- TestHasBlob / TestGetBlob / TestHasLayer / TestGetLayerByName ----------------------------------------------

def test_blobs_and_layers_in_caffe_order():
    g = graph(tiny_net())
    assert g.blobs == ["data", "label", "innerproduct", "top_loss"]  # 'loss' is a layer, not a blob
    assert [layer.name for layer in g.layers] == ["data", "innerproduct", "loss"]
    assert g.layer("loss").type == "SoftmaxWithLoss"
    with pytest.raises(KeyError):
        g.layer("label")


# ---- bottom_need_backward / layer_need_backward -----------------------------------------------------------------

def test_bottom_need_backward():
    g = graph(tiny_net())
    assert bottom_need_backward(g) == [[], [False], [True, False]]
    assert layer_need_backward(g) == {"data": False, "innerproduct": True, "loss": True}


def test_bottom_need_backward_force():
    g = graph(tiny_net(force_backward=True))
    # force_backward reaches the data, but not the label of SoftmaxWithLoss (AllowForceBackward false).
    assert bottom_need_backward(g) == [[], [True], [True, False]]
    assert all(layer_need_backward(g).values())


def test_bottom_need_backward_euclidean_force():
    g = graph(tiny_net_euclidean(force_backward=True))
    assert bottom_need_backward(g) == [[], [True], [True, True]]  # EuclideanLoss allows both bottoms


def test_bottom_need_backward_tricky():
    g = graph(tricky_net())
    # The label feeds a layer with weights, so the loss says its label needs backward (Caffe's test notes
    # this would crash SoftmaxWithLoss's backward; the flags are what Caffe computes).
    assert bottom_need_backward(g) == [[], [False], [False], [True, True]]


def test_skip_propagate_down_false_keeps_label_backward():
    g = graph(skip_prop_net(skip=False))
    loss = g.layer("loss")
    assert loss.bottom_need_backward[1] is True
    # layer_need_backward is true except for data layers (the split of 'data' too) and silence.
    assert layer_need_backward(g) == {"data": False, "data_data_0_split": False, "silence": False,
                                      "innerproduct": True, "ip_fake_labels": True, "argmax": True, "loss": True}


def test_skip_propagate_down_true_skips_label_branch():
    g = graph(skip_prop_net(skip=True))
    assert g.layer("loss").bottom_need_backward == [True, False]
    # Everything below the skipped label is cut off: only innerproduct and loss need backward.
    assert layer_need_backward(g) == {"data": False, "data_data_0_split": False, "silence": False,
                                      "innerproduct": True, "ip_fake_labels": False, "argmax": False, "loss": True}


@pytest.mark.parametrize("force, data_needs", [(False, False), (True, True)])
def test_force_propagate_down(force, data_needs):
    g = graph(force_prop_net(force))
    assert bottom_need_backward(g) == [[], [data_needs], [True, False]]
    assert layer_need_backward(g) == {"data": False, "innerproduct": True, "loss": True}


def test_lr_mult_zero_and_no_bottom_need_means_no_backward():
    g = graph(SHAPED_DATA + """
        layer { name: 'ip' type: 'InnerProduct' inner_product_param { num_output: 2 }
                param { lr_mult: 0 } param { lr_mult: 0 } bottom: 'data' top: 'ip' }
        layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' }
    """)
    assert g.layer("ip").param_need_backward == [False, False]
    assert layer_need_backward(g) == {"data": False, "ip": False, "loss": False}


def test_layer_not_under_a_loss_needs_no_backward():
    g = graph(SHAPED_DATA + inner_product("ip", "data", "ip", 2) + """
        layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' loss_weight: 0 }
    """)
    assert layer_need_backward(g) == {"data": False, "ip": False, "loss": False}


def test_force_backward_uses_each_layers_own_rule_when_names_repeat():
    # Two layers share the name 'loss' (Caffe allows it); force_backward must ask each its own
    # AllowForceBackward: SoftmaxWithLoss refuses its label, EuclideanLoss takes both bottoms.
    g = graph("force_backward: true " + """
        layer { name: 'data' type: 'DummyData' top: 'a' top: 'label' top: 'b' top: 'target'
                dummy_data_param { shape { dim: 4 dim: 3 } shape { dim: 4 } shape { dim: 4 dim: 3 }
                                   shape { dim: 4 dim: 3 } } }
        layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'a' bottom: 'label' top: 'l1' }
        layer { name: 'loss' type: 'EuclideanLoss' bottom: 'b' bottom: 'target' top: 'l2' }
    """)
    assert bottom_need_backward(g) == [[], [True, False], [True, True]]


_TWO_POOLS = """
    layer { name: 'in' type: 'Input' top: 'x' input_param { shape { dim: 1 dim: 2 dim: 8 dim: 8 } } }
    layer { name: 'pool' type: 'Pooling' bottom: 'x' top: 'a' pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
    layer { name: '%s' type: 'Pooling' bottom: 'a' top: 'b' pooling_param { pool: AVE kernel_size: 2 stride: 1 } }
"""


def test_layers_sharing_a_name_run_as_the_separate_layers_caffe_makes_of_them():
    """caffejax keys a layer's kernel, data source and fused chain by its name: the second of two Pooling layers
    named alike ran with the first's window (a bare TypeError from inside JAX). A later layer of a taken name is
    'name#k' (the k-th of that name), and runs its own definition."""
    x = np.random.default_rng(0).standard_normal((1, 2, 8, 8)).astype(np.float32)
    same, distinct = (caffejax.Net(_TWO_POOLS % name, caffejax.TEST) for name in ("pool", "pool2"))
    assert same._layer_names == ["in", "pool", "pool#2"]
    np.testing.assert_array_equal(same.forward(x=x)["b"], distinct.forward(x=x)["b"])
    assert same.forward(x=x)["b"].shape == (1, 2, 3, 3)
    g = build_graph(load_net_param(MODELS / "bvlc/examples/mnist/mnist_autoencoder.prototxt"), TRAIN)
    assert [layer.name for layer in g.layers if layer.name.startswith("loss")] == ["loss", "loss#2"]
    assert [layer.type for layer in g.layers if layer.name.startswith("loss")] == ["SigmoidCrossEntropyLoss",
                                                                                 "EuclideanLoss"]


def test_a_layer_with_weights_and_an_earlier_layers_name_has_its_own_weights():
    """Caffe's TrickyNet (test_net.cpp) names two InnerProduct layers alike; each has its own learnable blobs."""
    text = ("layer { name: 'in' type: 'Input' top: 'x' input_param { shape { dim: 1 dim: 3 } } }\n"
            "layer { name: 'ip' type: 'InnerProduct' bottom: 'x' top: 'a' inner_product_param { num_output: 2 } }\n"
            "layer { name: 'ip' type: 'InnerProduct' bottom: 'a' top: 'b' inner_product_param { num_output: 4 } }\n")
    net = caffejax.Net(text, caffejax.TEST)
    assert {name: [blob.data.shape for blob in blobs] for name, blobs in net.params.items()} == {
        "ip": [(2, 3), (2,)], "ip#2": [(4, 2), (4,)]}
    net.params["ip"][0].data[...] = 1.0
    net.params["ip#2"][0].data[...] = 2.0
    np.testing.assert_array_equal(net.forward(x=np.ones((1, 3), np.float32))["b"], 12.0)
    assert [layer.name for layer in graph(tricky_net()).layers][1:3] == ["innerproduct", "innerproduct#2"]
    # An error about the third 'ip' points at its own line.
    with pytest.raises(ShapeError, match=r"^<string>:4: layer 'ip#3' \(type Reshape\): output count must match"):
        caffejax.Net(text + "layer { name: 'ip' type: 'Reshape' bottom: 'b' top: 'c' "
                            "reshape_param { shape { dim: 7 } } }\n", caffejax.TEST)


# ---- outputs, inputs, loss weights ------------------------------------------------------------------------------

def test_outputs_sorted_by_name_and_inputs_in_order():
    g = graph("""
        layer { name: 'in' type: 'Input' top: 'zeta' top: 'alpha' top: 'mid'
                input_param { shape { dim: 2 dim: 3 } } }
        layer { name: 'relu' type: 'ReLU' bottom: 'zeta' top: 'zeta' }
        layer { name: 'sig' type: 'Sigmoid' bottom: 'mid' top: 'out' }
    """, TEST)
    assert g.inputs == ["zeta", "alpha", "mid"]
    assert g.outputs == ["alpha", "out", "zeta"]  # a std::set in Caffe; in-place 'zeta' is still available
    assert g.blobs == ["zeta", "alpha", "mid", "out"]
    assert all(g.blob_shape(b) == (2, 3) for b in g.blobs)
    assert [layer.is_input for layer in g.layers] == [True, False, False]


def test_loss_weights_per_blob():
    g = graph(tiny_net())
    assert g.blob_loss_weights == {"data": 0.0, "label": 0.0, "innerproduct": 0.0, "top_loss": 1.0}
    assert g.layer("loss").loss_weights == [1.0]  # LossLayer's default


def test_anonymous_loss_top():
    g = graph(tiny_net_euclidean())
    loss = g.layer("loss")
    assert loss.tops == [AUTOMATIC_TOP] and AUTOMATIC_TOP == "(automatic)"
    assert loss.loss_weights == [1.0]
    assert g.blob_loss_weights[AUTOMATIC_TOP] == 1.0
    assert g.value_shapes[loss.top_values[0]] == ()
    assert AUTOMATIC_TOP not in g.outputs  # anonymous tops are not available to other layers
    assert g.blobs[-1] == AUTOMATIC_TOP    # but Caffe lists them among the blobs, as pycaffe's net.blobs shows


def test_explicit_loss_weights():
    g = graph(skip_prop_net(skip=False))
    assert g.blob_loss_weights["cross_entropy_loss"] == pytest.approx(0.1)
    # A loss_weight on a non-loss layer whose top is also read elsewhere moves to the inserted Split.
    g = graph(LEGACY_DATA + """
        layer { name: 'ip1' type: 'InnerProduct' inner_product_param { num_output: 1 }
                bottom: 'data' top: 'ip1' loss_weight: 2.5 }
        layer { name: 'loss' type: 'EuclideanLoss' bottom: 'ip1' bottom: 'label' top: 'l' }
    """)
    assert g.layer("ip1").loss_weights == [0.0]
    assert g.layer("ip1_ip1_0_split").loss_weights == [2.5, 0.0]
    assert g.blob_loss_weights["ip1_ip1_0_split_0"] == 2.5
    assert g.blob_loss_weights["ip1"] == 0.0


def test_loss_layer_with_two_tops_needs_two_loss_weights():
    with pytest.raises(CaffejaxError, match=r"'loss'.*loss_weight.*once per top"):
        graph(SHAPED_DATA + inner_product("ip", "data", "ip", 3) + """
            layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'l' top: 'prob' }
        """)
    g = graph(SHAPED_DATA + inner_product("ip", "data", "ip", 3) + """
        layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'l' top: 'prob'
                loss_weight: 1 loss_weight: 0 }
    """)
    assert g.blob_loss_weights["l"] == 1.0 and g.blob_loss_weights["prob"] == 0.0
    assert g.blob_shape("prob") == (5, 3)


# ---- wiring errors ----------------------------------------------------------------------------------------------

INPUT_X = "layer { name: 'in' type: 'Input' top: 'x' input_param { shape { dim: 2 dim: 3 dim: 4 dim: 5 } } }"


def test_top_produced_twice():
    with pytest.raises(GraphError, match=r"layer 'second'.*'x'.*multiple sources"):
        graph(INPUT_X + "layer { name: 'second' type: 'Input' top: 'x' input_param { shape { dim: 1 } } }")


def test_top_reusing_a_bottom_name_at_another_index():
    # In place means top[i] == bottom[i]; the same name at another index is a second producer.
    with pytest.raises(GraphError, match=r"layer 'slice'.*'x'"):
        graph(INPUT_X + "layer { name: 'slice' type: 'Slice' bottom: 'x' top: 'y' top: 'x' }")


def test_in_place_refused_by_layer_type():
    with pytest.raises(GraphError, match=r"layer 'flat'.*Flatten.*in place"):
        graph(INPUT_X + "layer { name: 'flat' type: 'Flatten' bottom: 'x' top: 'x' }")


@pytest.mark.parametrize("layer", [
    "type: 'Convolution' convolution_param { num_output: 4 kernel_size: 3 }",
    "type: 'Pooling' pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }",
    "type: 'Deconvolution' convolution_param { num_output: 3 kernel_size: 4 stride: 2 }",
])
def test_a_layer_in_place_must_keep_its_blobs_shape(layer):
    """A conv, pooling or deconvolution writing over its own bottom reached XLA with the input's shape for its
    output's value (a bare TypeError from inside JAX; found by fuzzing). Caffe would reshape the shared blob and
    fail on the next pass; a layer keeping the shape (ReLU, a same-size pooling) stays in place."""
    with pytest.raises(ShapeError, match=r"layer 'l' \(type \w+\): runs in place on blob 'x' but changes its "
                                         r"shape \(2, 3, 4, 5\) -> \("):
        caffejax.Net(INPUT_X + f"layer {{ name: 'l' bottom: 'x' top: 'x' {layer} }}", caffejax.TEST)
    same = graph(INPUT_X + "layer { name: 'l' type: 'Pooling' bottom: 'x' top: 'x' "
                           "pooling_param { pool: MAX kernel_size: 3 pad: 1 } }")
    assert same.value_shapes[same.blob_value["x"]] == (2, 3, 4, 5)


def test_unknown_layer_type():
    with pytest.raises(GraphError, match=r"layer 'mystery'.*Frobnicate"):
        graph(INPUT_X + "layer { name: 'mystery' type: 'Frobnicate' bottom: 'x' top: 'y' }")


def test_unknown_bottom():
    with pytest.raises(GraphError, match=r"layer 'relu'.*'nowhere'"):
        graph(INPUT_X + "layer { name: 'relu' type: 'ReLU' bottom: 'nowhere' top: 'y' }")


def test_propagate_down_count_must_match_bottoms():
    with pytest.raises(SchemaError, match=r"layer 'relu'.*propagate_down"):
        graph(INPUT_X + "layer { name: 'relu' type: 'ReLU' bottom: 'x' top: 'y' "
                        "propagate_down: true propagate_down: false }")


def test_too_many_param_specs():
    with pytest.raises(SchemaError, match=r"layer 'ip'.*3 param specs.*2 learnable"):
        graph(INPUT_X + "layer { name: 'ip' type: 'InnerProduct' inner_product_param { num_output: 2 } "
                        "param {} param {} param {} bottom: 'x' top: 'y' }")


def test_in_place_values():
    g = graph(INPUT_X + """
        layer { name: 'conv1' type: 'Convolution' bottom: 'x' top: 'conv1'
                convolution_param { num_output: 4 kernel_size: 3 } }
        layer { name: 'relu1' type: 'ReLU' bottom: 'conv1' top: 'conv1' }
        layer { name: 'drop1' type: 'Dropout' bottom: 'conv1' top: 'conv1' }
    """)
    conv, relu, drop = g.layer("conv1"), g.layer("relu1"), g.layer("drop1")
    assert conv.top_values == ["conv1"]
    assert relu.bottom_values == ["conv1"] and relu.top_values == ["conv1@2"]
    assert drop.bottom_values == ["conv1@2"] and drop.top_values == ["conv1@3"]
    assert relu.in_place == [True] and conv.in_place == [False]
    assert g.blobs == ["x", "conv1"]
    assert g.blob_first_value["conv1"] == "conv1" and g.blob_value["conv1"] == "conv1@3"
    assert {g.value_shapes[v] for v in ("conv1", "conv1@2", "conv1@3")} == {(2, 4, 2, 3)}


# ---- Input shapes ----------------------------------------------------------------------------------------------

def test_input_layer_shapes():
    g = graph("""
        layer { name: 'one_for_all' type: 'Input' top: 'a' top: 'b' input_param { shape { dim: 2 dim: 3 } } }
        layer { name: 'one_each' type: 'Input' top: 'c' top: 'd'
                input_param { shape { dim: 1 } shape { dim: 4 dim: 5 dim: 6 } } }
    """, TEST)
    assert [g.blob_shape(b) for b in "abcd"] == [(2, 3), (2, 3), (1,), (4, 5, 6)]
    assert g.inputs == ["a", "b", "c", "d"]


def test_input_shapes_override_reshapes_downstream():
    text = INPUT_X + "layer { name: 'ip' type: 'InnerProduct' inner_product_param { num_output: 7 } " \
                     "bottom: 'x' top: 'y' }"
    g = graph(text, input_shapes={"x": (8, 3, 4, 5)})
    assert g.blob_shape("x") == (8, 3, 4, 5) and g.blob_shape("y") == (8, 7)
    assert g.layer("ip").params[0].shape == (7, 60)


def test_legacy_input_fields_become_an_input_layer():
    g = graph("input: 'data' input_dim: 1 input_dim: 3 input_dim: 8 input_dim: 8 "
              "layer { name: 'relu' type: 'ReLU' bottom: 'data' top: 'out' }", TEST)
    assert [(layer.name, layer.type) for layer in g.layers] == [("input", "Input"), ("relu", "ReLU")]
    assert g.inputs == ["data"] and g.blob_shape("out") == (1, 3, 8, 8)


# ---- param sharing ----------------------------------------------------------------------------------------------

def shared_ip_net(spec1: str, spec2: str, num_output2: int = 10, bottom2: str = "data") -> str:
    loss = "layer { name: 'loss' type: 'EuclideanLoss' bottom: 'innerproduct1' bottom: 'innerproduct2' }"
    return f"""
        layer {{ name: 'data' type: 'DummyData' top: 'data' top: 'other'
                dummy_data_param {{ shape {{ dim: 5 dim: 2 dim: 3 dim: 4 }} shape {{ dim: 5 dim: 12 }} }} }}
        layer {{ name: 'innerproduct1' type: 'InnerProduct' bottom: 'data' top: 'innerproduct1'
                inner_product_param {{ num_output: 10 bias_term: false }} param {{ {spec1} }} }}
        layer {{ name: 'innerproduct2' type: 'InnerProduct' bottom: '{bottom2}' top: 'innerproduct2'
                inner_product_param {{ num_output: {num_output2} bias_term: false }} param {{ {spec2} }} }}
        {loss if num_output2 == 10 else ""}
    """


def test_shared_weights():
    g = graph(shared_ip_net("name: 'sharedweights'", "name: 'sharedweights'"))
    owner, sharer = g.layer("innerproduct1").params[0], g.layer("innerproduct2").params[0]
    assert owner.is_owner and owner.storage == ("innerproduct1", 0)
    assert sharer.owner == ("innerproduct1", 0) and sharer.storage == ("innerproduct1", 0)
    assert [s.key for s in g.learnable_slots] == [("innerproduct1", 0)]
    assert [s.key for s in g.param_slots] == [("innerproduct1", 0), ("innerproduct2", 0)]


def test_unshared_weights_with_distinct_names():
    g = graph(shared_ip_net("name: 'unsharedweights1'", "name: 'unsharedweights2'"))
    assert [s.key for s in g.learnable_slots] == [("innerproduct1", 0), ("innerproduct2", 0)]


def test_strict_sharing_shape_mismatch_names_both_shapes():
    # Owner W is 10x24 (K = 2*3*4); the sharer reads 'other' (K = 12): 10x12.
    with pytest.raises(ShapeError, match=r"'innerproduct2'.*'w'.*'innerproduct1'.*\(10, 24\).*\(10, 12\)"):
        graph(shared_ip_net("name: 'w'", "name: 'w'", bottom2="other"))


def test_strict_sharing_same_count_other_shape_fails():
    # 20x12 has the owner's count (240) but not its shape: STRICT (the default) refuses it.
    with pytest.raises(ShapeError, match=r"\(10, 24\).*\(20, 12\)"):
        graph(shared_ip_net("name: 'w'", "name: 'w'", num_output2=20, bottom2="other"))


def test_permissive_sharing_checks_count_only():
    g = graph(shared_ip_net("name: 'w'", "name: 'w' share_mode: PERMISSIVE", num_output2=20, bottom2="other"))
    assert g.layer("innerproduct2").params[0].shape == (20, 12)
    assert g.layer("innerproduct2").params[0].owner == ("innerproduct1", 0)
    with pytest.raises(ShapeError, match=r"count mismatch.*\(10, 24\).*\(10, 12\)"):
        graph(shared_ip_net("name: 'w'", "name: 'w' share_mode: PERMISSIVE", bottom2="other"))


def test_shared_lr_mult_inherited_by_the_owner():
    # The owner sets no lr_mult; the sharer's explicit one becomes the owner's (and so every sharer's).
    g = graph(shared_ip_net("name: 'w'", "name: 'w' lr_mult: 3 decay_mult: 0.5"))
    owner, sharer = g.layer("innerproduct1").params[0], g.layer("innerproduct2").params[0]
    assert (owner.lr_mult, owner.decay_mult) == (3.0, 0.5)
    assert (sharer.lr_mult, sharer.decay_mult) == (3.0, 0.5)


def test_shared_lr_mult_mismatch():
    with pytest.raises(SchemaError, match=r"'innerproduct2'.*'w'.*mismatched lr_mult"):
        graph(shared_ip_net("name: 'w' lr_mult: 1", "name: 'w' lr_mult: 2"))
    with pytest.raises(SchemaError, match=r"'innerproduct2'.*'w'.*mismatched decay_mult"):
        graph(shared_ip_net("name: 'w' decay_mult: 1", "name: 'w' decay_mult: 0"))


def test_sharer_param_propagate_down_comes_from_its_own_spec():
    # Net::Init sets param_propagate_down from the layer's own ParamSpec (lr_mult defaults to 1), before
    # sharing is resolved: a sharer without lr_mult still backpropagates into the frozen owner's diff.
    g = graph(shared_ip_net("name: 'w' lr_mult: 0", "name: 'w'"))
    assert g.layer("innerproduct1").param_need_backward == [False]
    assert g.layer("innerproduct2").param_need_backward == [True]
    assert g.layer("innerproduct2").params[0].lr_mult == 0.0  # the solver still uses the owner's multiplier
    assert layer_need_backward(g) == {"data": False, "data_data_0_split": False, "innerproduct1": False,
                                      "innerproduct2": True, "loss": True}


# ---- learnable blob shapes (LayerSetUp) -------------------------------------------------------------------------

def input_layers(*shapes: tuple[int, ...]) -> str:
    """Input layers feeding blobs b0, b1, ... of the given shapes."""
    return "".join(f"layer {{ name: 'in{i}' type: 'Input' top: 'b{i}' "
                   f"input_param {{ shape {{ {' '.join(f'dim: {d}' for d in shape)} }} }} }}"
                   for i, shape in enumerate(shapes))


def param_shapes(layer_text: str, *bottom_shapes: tuple[int, ...]) -> list[tuple[int, ...]]:
    g = graph(input_layers(*bottom_shapes) + layer_text, TEST)
    return [slot.shape for slot in g.layer("L").params]


@pytest.mark.parametrize("layer_text, bottoms, expected", [
    ("layer { name: 'L' type: 'Convolution' bottom: 'b0' top: 't' "
     "convolution_param { num_output: 6 kernel_size: 3 group: 2 } }", [(2, 4, 9, 9)], [(6, 2, 3, 3), (6,)]),
    ("layer { name: 'L' type: 'Convolution' bottom: 'b0' top: 't' "
     "convolution_param { num_output: 6 kernel_h: 3 kernel_w: 5 bias_term: false } }", [(2, 4, 9, 9)],
     [(6, 4, 3, 5)]),
    # Deconvolution swaps the channel axes: Cin x Cout/group x k x k.
    ("layer { name: 'L' type: 'Deconvolution' bottom: 'b0' top: 't' "
     "convolution_param { num_output: 6 kernel_size: 4 stride: 2 group: 2 } }", [(2, 4, 5, 5)],
     [(4, 3, 4, 4), (6,)]),
    ("layer { name: 'L' type: 'InnerProduct' bottom: 'b0' top: 't' inner_product_param { num_output: 7 } }",
     [(2, 3, 4, 5)], [(7, 60), (7,)]),
    ("layer { name: 'L' type: 'InnerProduct' bottom: 'b0' top: 't' "
     "inner_product_param { num_output: 7 transpose: true } }", [(2, 3, 4, 5)], [(60, 7), (7,)]),
    ("layer { name: 'L' type: 'InnerProduct' bottom: 'b0' top: 't' "
     "inner_product_param { num_output: 7 axis: 2 bias_term: false } }", [(2, 3, 4, 5)], [(7, 20)]),
    ("layer { name: 'L' type: 'PReLU' bottom: 'b0' top: 't' }", [(2, 3, 4, 5)], [(3,)]),
    ("layer { name: 'L' type: 'PReLU' bottom: 'b0' top: 't' prelu_param { channel_shared: true } }",
     [(2, 3, 4, 5)], [()]),
    ("layer { name: 'L' type: 'Scale' bottom: 'b0' top: 't' }", [(2, 3, 4, 5)], [(3,)]),
    ("layer { name: 'L' type: 'Scale' bottom: 'b0' top: 't' scale_param { bias_term: true num_axes: -1 } }",
     [(2, 3, 4, 5)], [(3, 4, 5), (3, 4, 5)]),
    ("layer { name: 'L' type: 'Scale' bottom: 'b0' top: 't' scale_param { axis: 0 num_axes: 0 } }",
     [(2, 3, 4, 5)], [()]),
    ("layer { name: 'L' type: 'Scale' bottom: 'b0' bottom: 'b1' top: 't' }", [(2, 3, 4, 5), (3, 4)], []),
    ("layer { name: 'L' type: 'Bias' bottom: 'b0' top: 't' bias_param { axis: 2 num_axes: 2 } }",
     [(2, 3, 4, 5)], [(4, 5)]),
    ("layer { name: 'L' type: 'Embed' bottom: 'b0' top: 't' embed_param { input_dim: 11 num_output: 6 } }",
     [(2, 3)], [(11, 6), (6,)]),
    ("layer { name: 'L' type: 'BatchNorm' bottom: 'b0' top: 't' }", [(2, 3, 4, 5)], [(3,), (3,), (1,)]),
    # LSTM: W_xc 4N x I, b_c 4N, W_hc 4N x N (bottoms: x T x B x I, cont T x B).
    ("layer { name: 'L' type: 'LSTM' bottom: 'b0' bottom: 'b1' top: 't' recurrent_param { num_output: 5 } }",
     [(3, 2, 7), (3, 2)], [(20, 7), (20,), (20, 5)]),
    ("layer { name: 'L' type: 'Parameter' top: 't' parameter_param { shape { dim: 2 dim: 9 } } }", [],
     [(2, 9)]),
], ids=["conv_group", "conv_rect_nobias", "deconv_group", "ip", "ip_transpose", "ip_axis2", "prelu",
        "prelu_shared", "scale", "scale_bias_all_axes", "scale_scalar", "scale_two_bottoms", "bias_axis2",
        "embed", "batchnorm", "lstm", "parameter"])
def test_learnable_blob_shapes(layer_text, bottoms, expected):
    assert param_shapes(layer_text, *bottoms) == expected


def test_batch_norm_statistics_are_not_learned():
    g = graph(INPUT_X + "layer { name: 'bn' type: 'BatchNorm' bottom: 'x' top: 'x' }")
    assert [slot.lr_mult for slot in g.layer("bn").params] == [0.0, 0.0, 0.0]
    assert g.layer("bn").param_need_backward == [False, False, False]


# ---- top shapes (Reshape) ----------------------------------------------------------------------------------------

def top_shapes(layer_text: str, *bottom_shapes: tuple[int, ...]) -> list[tuple[int, ...]]:
    g = graph(input_layers(*bottom_shapes) + layer_text, TEST)
    return [g.value_shapes[v] for v in g.layer("L").top_values]


def pool(params: str) -> str:
    return f"layer {{ name: 'L' type: 'Pooling' bottom: 'b0' top: 't' pooling_param {{ {params} }} }}"


def conv(type_: str, params: str) -> str:
    return f"layer {{ name: 'L' type: '{type_}' bottom: 'b0' top: 't' convolution_param {{ num_output: 2 {params} }} }}"


@pytest.mark.parametrize("layer_text, bottoms, expected", [
    # Pooling, CEIL (default): ceil((H + 2p - k) / s) + 1, then clipped if the last window starts in the pad.
    (pool("pool: MAX kernel_size: 3 stride: 2"), [(1, 1, 8, 8)], [(1, 1, 4, 4)]),    # ceil(5/2)+1
    (pool("pool: MAX kernel_size: 3 stride: 2 round_mode: FLOOR"), [(1, 1, 8, 8)], [(1, 1, 3, 3)]),
    (pool("pool: AVE kernel_size: 3 stride: 2 pad: 1"), [(1, 1, 6, 6)], [(1, 1, 4, 4)]),  # ceil(5/2)+1, 6 < 7
    (pool("pool: MAX kernel_size: 2 stride: 2 pad: 1"), [(1, 1, 5, 5)], [(1, 1, 3, 3)]),  # 4, (4-1)*2 >= 6 -> 3
    (pool("pool: MAX kernel_h: 3 kernel_w: 2 stride_h: 1 stride_w: 2"), [(2, 3, 5, 7)], [(2, 3, 3, 4)]),
    (pool("pool: AVE global_pooling: true"), [(2, 3, 5, 7)], [(2, 3, 1, 1)]),
    (pool("pool: MAX kernel_size: 2 stride: 2"), [(1, 1, 4, 4)], [(1, 1, 2, 2)]),
    # Convolution: floor((H + 2p - d(k-1) - 1) / s) + 1.
    (conv("Convolution", "kernel_size: 5"), [(1, 1, 28, 28)], [(1, 2, 24, 24)]),
    (conv("Convolution", "kernel_size: 3 stride: 2 pad: 1 dilation: 2"), [(1, 1, 7, 9)], [(1, 2, 3, 4)]),
    (conv("Convolution", "kernel_size: 3 stride: 2"), [(1, 1, 8, 8)], [(1, 2, 3, 3)]),  # floor(5/2)+1
    # Deconvolution: s(H - 1) + d(k - 1) + 1 - 2p.
    (conv("Deconvolution", "kernel_size: 4 stride: 2 pad: 1"), [(1, 1, 4, 5)], [(1, 2, 8, 10)]),
    (conv("Deconvolution", "kernel_size: 3 stride: 1 dilation: 2"), [(1, 1, 4, 4)], [(1, 2, 8, 8)]),
    # Crop: every axis from `axis` (default 2) on takes bottom[1]'s size.
    ("layer { name: 'L' type: 'Crop' bottom: 'b0' bottom: 'b1' top: 't' crop_param { offset: 1 } }",
     [(1, 3, 10, 12), (5, 7, 6, 7)], [(1, 3, 6, 7)]),
    ("layer { name: 'L' type: 'Crop' bottom: 'b0' bottom: 'b1' top: 't' crop_param { axis: 1 } }",
     [(1, 3, 10, 12), (5, 2, 6, 7)], [(1, 2, 6, 7)]),
    # Reshape: 0 copies, -1 infers, axis/num_axes select the replaced range; a negative axis counts as
    # ndim + axis + 1 (so -1 appends).
    ("layer { name: 'L' type: 'Reshape' bottom: 'b0' top: 't' reshape_param { shape { dim: 0 dim: -1 } } }",
     [(2, 3, 4, 5)], [(2, 60)]),
    ("layer { name: 'L' type: 'Reshape' bottom: 'b0' top: 't' "
     "reshape_param { shape { dim: 1 dim: 3 } axis: 1 num_axes: 1 } }", [(2, 3, 4, 5)], [(2, 1, 3, 4, 5)]),
    ("layer { name: 'L' type: 'Reshape' bottom: 'b0' top: 't' "
     "reshape_param { shape { dim: 1 } axis: -1 num_axes: 0 } }", [(2, 3, 4, 5)], [(2, 3, 4, 5, 1)]),
    ("layer { name: 'L' type: 'Reshape' bottom: 'b0' top: 't' "
     "reshape_param { shape { dim: -1 } axis: 1 } }", [(2, 3, 4, 5)], [(2, 60)]),
    # Slice: at slice points, or evenly.
    ("layer { name: 'L' type: 'Slice' bottom: 'b0' top: 'a' top: 'b' top: 'c' "
     "slice_param { slice_point: 2 slice_point: 5 } }", [(2, 9, 4)], [(2, 2, 4), (2, 3, 4), (2, 4, 4)]),
    ("layer { name: 'L' type: 'Slice' bottom: 'b0' top: 'a' top: 'b' top: 'c' slice_param { axis: -1 } }",
     [(2, 4, 9)], [(2, 4, 3)] * 3),
    # SPP: levels with 1, 4, 16 bins, flattened and concatenated; a height-1 pyramid is one global pool.
    ("layer { name: 'L' type: 'SPP' bottom: 'b0' top: 't' spp_param { pyramid_height: 3 } }",
     [(2, 3, 7, 9)], [(2, 63)]),
    ("layer { name: 'L' type: 'SPP' bottom: 'b0' top: 't' spp_param { pyramid_height: 1 } }",
     [(2, 3, 7, 9)], [(2, 3, 1, 1)]),
    # ArgMax: (N, 1 or 2, top_k) without axis; with axis, that axis becomes top_k.
    ("layer { name: 'L' type: 'ArgMax' bottom: 'b0' top: 't' }", [(2, 10)], [(2, 1, 1)]),
    ("layer { name: 'L' type: 'ArgMax' bottom: 'b0' top: 't' argmax_param { out_max_val: true top_k: 3 } }",
     [(2, 10)], [(2, 2, 3)]),
    ("layer { name: 'L' type: 'ArgMax' bottom: 'b0' top: 't' argmax_param { axis: 1 top_k: 3 } }",
     [(2, 10, 5)], [(2, 3, 5)]),
], ids=["pool_ceil", "pool_floor", "pool_pad", "pool_pad_clip", "pool_rect", "pool_global", "pool_exact",
        "conv", "conv_dilated", "conv_floor", "deconv", "deconv_dilated", "crop_axis2", "crop_axis1",
        "reshape_infer", "reshape_range", "reshape_negative_axis", "reshape_axis1", "slice_points",
        "slice_even", "spp3", "spp1", "argmax", "argmax_max_val", "argmax_axis"])
def test_top_shapes(layer_text, bottoms, expected):
    assert top_shapes(layer_text, *bottoms) == expected


@pytest.mark.parametrize("layer_text, bottoms, match", [
    ("layer { name: 'L' type: 'Crop' bottom: 'b0' bottom: 'b1' top: 't' crop_param { offset: 5 } }",
     [(1, 3, 10, 12), (1, 3, 6, 7)], "'L'"),
    ("layer { name: 'L' type: 'Reshape' bottom: 'b0' top: 't' reshape_param { shape { dim: 7 dim: -1 } } }",
     [(2, 3, 4, 5)], "'L'"),
    ("layer { name: 'L' type: 'InnerProduct' bottom: 'b0' bottom: 'b1' top: 't' "
     "inner_product_param { num_output: 2 } }", [(2, 3), (2, 3)], "'L'"),
    ("layer { name: 'L' type: 'Convolution' bottom: 'b0' top: 't' "
     "convolution_param { num_output: 2 kernel_size: 5 } }", [(1, 1, 3, 3)], "'L'"),
], ids=["crop_offset_too_big", "reshape_count", "ip_two_bottoms", "conv_kernel_too_big"])
def test_shapes_that_do_not_fit_name_the_layer(layer_text, bottoms, match):
    with pytest.raises(CaffejaxError, match=match):
        top_shapes(layer_text, *bottoms)
