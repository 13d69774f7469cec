"""caffejax's error hierarchy.

Every problem caused by the user's input (a prototxt, a caffemodel, a solver file, a data source, shapes
that do not fit) is reported as a subclass of :class:`CaffejaxError`, carrying enough context to find the
fault without a debugger: the file and line, the layer, the blob, the shapes involved.
"""

from __future__ import annotations


class CaffejaxError(Exception):
    """Base class of every error caffejax raises for bad input.

    ``layer`` names the layer the error is about (set by :func:`layer_error`), so the frontend can put the
    prototxt's ``file:line`` of that layer in front of the message (:func:`at_location`).
    """

    layer: str | None = None
    located = False


class ParseError(CaffejaxError):
    """A prototxt or binary protobuf file could not be parsed.

    ``path`` is the file (or ``"<string>"``), ``line``/``column`` are 1-based where known.
    """

    def __init__(self, message: str, path: str | None = None, line: int | None = None,
                 column: int | None = None, text: str | None = None):
        self.path, self.line, self.column, self.text = path, line, column, text
        where = path or "<string>"
        if line is not None:
            where += f":{line}"
            if column is not None:
                where += f":{column}"
        detail = f"{where}: {message}"
        if text:
            detail += f"\n    {text}"
        super().__init__(detail)


class SchemaError(CaffejaxError):
    """A field or value is not allowed by caffe.proto or by Caffe's rules (e.g. include with exclude)."""


class LrMultError(SchemaError, ValueError):
    """A learning layer with more param specs than learnable blobs (caffe.draw's display_lrm). Also a ValueError,
    which is what pycaffe's get_layer_lr_mult raised ("Could not parse the learning rate multiplier")."""


class UnsupportedError(CaffejaxError):
    """A feature caffejax knows of but does not run (e.g. a Python layer that was not allowed)."""


class GraphError(CaffejaxError):
    """The net's wiring is wrong: unknown layer type, dangling bottom, duplicate top, bad sharing."""


class ShapeError(CaffejaxError):
    """Blob shapes do not fit a layer's rule."""


class TopsSizedByData(ShapeError):
    """A Python layer's reshape or forward in a program gave its tops shapes of their own, sized by the data
    (py-faster-rcnn's ProposalLayer reshapes its rois in forward, to the proposals it kept). Net.forward and
    compile_inference catch it: the net then runs the layer on the host (PythonLayers.runs_on_host) and runs
    the pass again; anything else compiling one program over the layer raises it."""


class OutOfMemoryError(ShapeError, MemoryError):
    """The net's blobs do not fit in the host's or the device's memory (a mistyped dim, a batch too big)."""


class UnknownBlobError(GraphError, KeyError):
    """A blob name the net does not have (``net.forward(blobs=...)``, ``net.backward(diffs=...)``). Also a KeyError,
    which is what pycaffe raised (reading ``net.blobs[name]`` after the pass)."""

    __str__ = Exception.__str__  # the message as written, not KeyError's quoted repr


class WeightsError(CaffejaxError):
    """A caffemodel (binary or HDF5) does not fit the net, or is corrupted."""


class DataError(CaffejaxError):
    """A data source (LMDB, image list, HDF5 list, mean file) is missing or malformed."""


class BlobProtoError(WeightsError, ValueError):
    """A BlobProto whose values do not fill its shape (caffe.io). Also a ValueError, which is what pycaffe's
    reshape raised (BVLC's own test_io expects it for a blob without a shape)."""


class DatumError(DataError, ValueError):
    """A Datum whose pixels do not fill its channels x height x width (caffe.io). Also a ValueError, as pycaffe's
    reshape raised."""


class DataSourceUnavailable(DataError):
    """A data layer's source (LMDB, list file, HDF5 list) cannot be opened, so its top shapes are unknown."""


class SolverError(CaffejaxError):
    """A solver definition or solver state is invalid."""


class NumericalError(CaffejaxError):
    """A pass produced NaN or Inf (raised when NaN debugging is on; names the first layer that did)."""


def layer_error(cls: type[CaffejaxError], layer_name: str, layer_type: str, message: str) -> CaffejaxError:
    """Build an error that names the layer the way every layer-level message does."""
    error = cls(f"layer '{layer_name}' (type {layer_type}): {message}")
    error.layer = layer_name
    return error


def at_location(error: CaffejaxError, where: str) -> CaffejaxError:
    """The same kind of error with ``where`` (``file:line``) in front of its message."""
    located = prefixed(error, where)
    located.located = True
    return located


def prefixed(error: CaffejaxError, prefix: str) -> CaffejaxError:
    """The same kind of error with ``prefix`` in front of its message, naming the same layer."""
    made = type(error)(f"{prefix}: {error}")
    made.layer = error.layer
    return made


class NetInUseError(CaffejaxError, RuntimeError):
    """A Net's pass (forward, backward, reshape, a solver's step) called from one thread while another thread's
    pass runs on the same Net, whose blobs both would fill."""


class InputValueError(CaffejaxError, ValueError):
    """An input (or a diff given to backward) a net cannot read as an array of numbers (strings, ragged nested
    lists), named by its blob. Also a ValueError, which is what NumPy's conversion raised."""


class InputArraysError(DataError, RuntimeError):
    """Arrays net.set_input_arrays cannot take: not NumPy arrays, not float32, not C contiguous. Also a
    RuntimeError, which is what pycaffe's set_input_arrays raised (boost.python's std::runtime_error)."""


class InputArraysShapeError(ShapeError, RuntimeError):
    """Arrays net.set_input_arrays cannot take for their shapes: not 4-D, not the MemoryData layer's channels x
    height x width, different numbers of data and labels, or a number that is no multiple of batch_size. Also a
    RuntimeError, as pycaffe raised."""


class DetectorWindowError(ShapeError, ValueError):
    """Windows caffe.Detector cannot crop: none at all, not four coordinates, coordinates out of order, or a
    window (grown by its context) with no pixel inside its image. Also a ValueError, which is what pycaffe's
    numpy and skimage calls mostly raised for them."""


class ImageFileError(DataError, OSError):
    """An image file caffe.io.load_image (and so caffe.Classifier's and caffe.Detector's callers) cannot read:
    missing, or not an image. Also an OSError, which is what pycaffe's caffe.io.load_image raised."""
