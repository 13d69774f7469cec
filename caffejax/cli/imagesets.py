"""Caffe's database tools: ``convert-imageset`` (tools/convert_imageset.cpp) writes images into an LMDB of
``Datum`` records for Caffe's Data layer, ``compute-image-mean`` (tools/compute_image_mean.cpp) averages one into
a ``.binaryproto`` mean file, and ``extract-features`` (tools/extract_features.cpp) stores a trained net's blobs,
one ``Datum`` per image, in new LMDBs.

Images are read as Caffe reads them with OpenCV (caffejax.data.images): colour as BGR, or gray, resized with
INTER_LINEAR when both --resize_height and --resize_width are set. A raw Datum holds the pixels as C x H x W
uint8 bytes; an encoded one holds an image file (the original file when it is neither resized nor of
another format than asked, else the image re-encoded).
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import random

import numpy as np

from caffejax.cli import add_gflags_bool
from caffejax.errors import CaffejaxError, DataError, UnsupportedError
from caffejax.runtime.mode import log_float

log = logging.getLogger("caffejax")

LMDB_MAP_SIZE = 1 << 40  # Caffe's LMDB_MAP_SIZE: 1 TB of address space; the file grows only as written
COMMIT_EVERY = 1000      # records per LMDB transaction, as convert_imageset commits
JPEG_QUALITY = 95        # cv::imencode's default JPEG quality


def add_commands(commands, parents) -> None:
    def command(name: str, run, help: str, description: str):
        """A subcommand named as Caffe's tool (convert_imageset) and GNU style (convert-imageset)."""
        parser = commands.add_parser(name, aliases=[name.replace("-", "_")], parents=parents, help=help,
                                     description=description)
        parser.set_defaults(run=run)
        return parser

    p = command(
        "convert-imageset", convert_imageset,
        help="convert a set of images to an LMDB of Datum records",
        description="Convert a set of images to the LMDB format used as input for Caffe (Caffe's "
                    "convert_imageset). LISTFILE has one 'path label' per line; paths are relative to ROOTFOLDER. "
                    "Keys are '%%08d_<path>' with the line number.")
    p.add_argument("root_folder", metavar="ROOTFOLDER", help="the folder the listed paths start from")
    p.add_argument("list_file", metavar="LISTFILE", help="'path label' lines")
    p.add_argument("db_name", metavar="DB_NAME", help="the database to create (must not exist)")
    add_gflags_bool(p, "gray", help="treat images as grayscale ones")
    add_gflags_bool(p, "shuffle", help="randomly shuffle the order of images and their labels")
    p.add_argument("-backend", "--backend", default="lmdb", help="the database backend: lmdb (default)")
    p.add_argument("-resize_width", "--resize_width", type=int, default=0, help="width images are resized to")
    p.add_argument("-resize_height", "--resize_height", type=int, default=0, help="height images are resized to")
    add_gflags_bool(p, "check_size", help="check that all the datum have the same size")
    add_gflags_bool(p, "encoded", help="store the encoded image in the datum")
    p.add_argument("-encode_type", "--encode_type", default="",
                   help="what type to encode the image as ('png', 'jpg', ...); implies --encoded")

    p = command(
        "compute-image-mean", compute_image_mean,
        help="compute the mean image of an image database",
        description="Compute the mean image of a set of images given by an LMDB (Caffe's compute_image_mean); "
                    "write it as a BlobProto (.binaryproto) when OUTPUT_FILE is given, and log each channel's "
                    "mean value.")
    p.add_argument("input_db", metavar="INPUT_DB", help="the database to read")
    p.add_argument("output_file", metavar="OUTPUT_FILE", nargs="?", help="the .binaryproto to write")
    p.add_argument("-backend", "--backend", default="lmdb", help="the database backend: lmdb (default)")

    p = command(
        "extract-features", extract_features,
        help="store a trained net's blobs, one Datum per image, in new databases",
        description="Run the TEST-phase net NUM_MINI_BATCHES times (its data layer reads the images) and store "
                    "each named blob's values, one Datum of float_data per image, in a new database per blob "
                    "(Caffe's extract_features). Keys are the image's index, 10 digits.")
    p.add_argument("pretrained_net_param", metavar="PRETRAINED_NET_PARAM", help="the trained weights (caffemodel)")
    p.add_argument("feature_extraction_proto", metavar="FEATURE_EXTRACTION_PROTO_FILE",
                   help="the net definition (prototxt), with a data layer")
    p.add_argument("blob_names", metavar="BLOB_NAME1[,NAME2,...]", help="the blobs to store")
    p.add_argument("dataset_names", metavar="DATASET_NAME1[,NAME2,...]",
                   help="the databases to create, one per blob (they must not exist)")
    p.add_argument("num_mini_batches", metavar="NUM_MINI_BATCHES", type=int, help="the number of forward passes")
    p.add_argument("db_type", metavar="DB_TYPE", help="the database backend: lmdb")
    p.add_argument("device", metavar="CPU|GPU", nargs="?", default="CPU", type=str.upper, choices=("CPU", "GPU"),
                   help="GPU runs where JAX's default backend is a GPU (default CPU)")
    p.add_argument("device_id", metavar="DEVICE_ID", nargs="?", type=_device_id, default=0, help="default 0")
    p.add_argument("--allow-python-layers", action="store_true",
                   help="run the net's Python layers, importing their modules (only for a model you trust)")


def _lmdb():
    try:
        import lmdb
    except ImportError:
        raise UnsupportedError("image databases need the 'lmdb' package: pip install 'caffejax[data]'") from None
    return lmdb


def _check_backend(backend: str) -> None:
    if backend.lower() != "lmdb":
        raise UnsupportedError(f"backend '{backend}' is not supported; caffejax writes and reads LMDB (--backend "
                               "lmdb)")


# ---- convert-imageset -------------------------------------------------------------------------------------

def convert_imageset(args) -> int:
    _check_backend(args.backend)
    encoding = args.encode_type.lower().lstrip(".")
    encoded = args.encoded or bool(encoding)
    if encoding and not args.encoded:
        log.info("encode_type specified, assuming encoded=true.")
    if encoded and args.check_size:
        raise CaffejaxError("--check_size compares raw pixel counts; it cannot be used with --encoded")
    try:
        # newline="": std::getline ends a line at "\n" only.
        with open(args.list_file, encoding="utf-8", errors="surrogateescape", newline="") as f:
            lines = _list_lines(f.read())
    except OSError as e:
        raise DataError(f"{args.list_file}: cannot read the list file: {e.strerror}") from None
    if args.shuffle:
        log.info("Shuffling data")
        random.Random(_seed()).shuffle(lines)
    log.info("A total of %d images.", len(lines))
    resize = (max(0, args.resize_height), max(0, args.resize_width))

    lmdb = _lmdb()
    if os.path.exists(args.db_name):
        raise DataError(f"{args.db_name}: already exists; convert-imageset creates a new database")
    os.makedirs(args.db_name)
    env = lmdb.open(args.db_name, map_size=LMDB_MAP_SIZE)
    count, data_size = 0, None
    try:
        txn = env.begin(write=True)
        for line_id, (name, label) in enumerate(lines):
            path = args.root_folder + name  # Caffe concatenates: give ROOTFOLDER with its trailing '/'
            image_encoding = encoding or (_extension(name) if encoded else "")
            try:
                datum = image_datum(path, label, resize, not args.gray, image_encoding)
            except DataError as e:
                log.error("%s", e)  # Caffe skips an unreadable image and goes on
                continue
            if args.check_size:
                size = datum.channels * datum.height * datum.width
                if data_size is None:
                    data_size = size
                elif len(datum.data) != data_size:
                    raise DataError(f"{path}: Incorrect data field size {len(datum.data)} (the first image has "
                                    f"{data_size}); use --resize_height and --resize_width")
            txn.put(f"{line_id:08d}_{name}".encode("utf-8", "surrogateescape"), datum.SerializeToString())
            count += 1
            if count % COMMIT_EVERY == 0:
                txn.commit()
                txn = env.begin(write=True)
                log.info("Processed %d files.", count)
        txn.commit()
        if count % COMMIT_EVERY:
            log.info("Processed %d files.", count)
    finally:
        env.close()
    return 0


def _list_lines(text: str) -> list[tuple[str, int]]:
    """convert_imageset's list: a (path, label) per line std::getline reads, blank ones too (parse_list skips
    them). Caffe fails to read a blank line's image and goes on, but the line still takes its number, which is
    in the keys of the lines after it."""
    from caffejax.data.common import C_WHITESPACE
    from caffejax.data.image_data import parse_line

    rows = text.split("\n")
    if rows and not rows[-1]:
        rows.pop()  # the end of the last line, not a line
    # A blank line keeps its place: its image (the line itself) fails to read, as in Caffe.
    return [parse_line(row) if row.strip(C_WHITESPACE) else (row, 0) for row in rows]


def _seed() -> int:
    from caffejax.runtime import mode

    return mode.random_seed()


def _extension(name: str) -> str:
    """The encoding guessed from a file name, as convert_imageset guesses it."""
    ext = os.path.splitext(name)[1].lstrip(".").lower()
    if not ext:
        log.warning("Failed to guess the encoding of '%s'", name)
    return ext


def image_datum(path: str, label: int, resize: tuple[int, int], is_color: bool, encoding: str = ""):
    """ReadImageToDatum: the image at ``path`` as a Datum (raw C x H x W bytes, or encoded as ``encoding``)."""
    from caffejax.data.images import read_image, resize_linear
    from caffejax.proto import caffe_pb2

    image = read_image(path, "color" if is_color else "gray")
    resized = resize[0] > 0 and resize[1] > 0
    if resized:
        image = resize_linear(image, *resize)
    if encoding:
        if not resized and _same_format(path, encoding):
            with open(path, "rb") as f:  # ReadFileToDatum: the file itself
                data = f.read()
        else:
            data = encode_image(image, encoding, path)
        return caffe_pb2.Datum(data=data, label=label, encoded=True)
    height, width, channels = image.shape
    return caffe_pb2.Datum(channels=channels, height=height, width=width, label=label, encoded=False,
                           data=np.ascontiguousarray(image.transpose(2, 0, 1)).tobytes())


def _same_format(path: str, encoding: str) -> bool:
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    return ext == encoding or (encoding == "jpg" and ext == "jpeg")


def encode_image(image: np.ndarray, encoding: str, where: str) -> bytes:
    """``cv::imencode``: an H x W x C uint8 image (BGR, or 1 channel) as an image file of type ``encoding``."""
    from caffejax.data.images import _pillow

    Image = _pillow()
    fmt = Image.registered_extensions().get("." + encoding)
    if fmt is None:
        raise DataError(f"{where}: cannot encode images as '{encoding}' (no such image format)")
    pixels = image[:, :, 0] if image.shape[2] == 1 else image[:, :, 2::-1]  # BGR -> RGB for Pillow
    out = io.BytesIO()
    options = {"quality": JPEG_QUALITY} if fmt == "JPEG" else {}
    Image.fromarray(np.ascontiguousarray(pixels)).save(out, format=fmt, **options)
    return out.getvalue()


# ---- compute-image-mean -----------------------------------------------------------------------------------

def compute_image_mean(args) -> int:
    """Sum every Datum (decoded as stored: DecodeDatumNative) in float32, divide by the count."""
    from caffejax.data.data_layer import datum_image
    from caffejax.fileio import atomic_write
    from caffejax.proto import caffe_pb2

    _check_backend(args.backend)
    lmdb = _lmdb()
    if not os.path.isdir(args.input_db):
        raise DataError(f"{args.input_db}: no such LMDB (a directory holding data.mdb)")
    try:
        env = lmdb.open(args.input_db, readonly=True, lock=False)
    except lmdb.Error as e:
        raise DataError(f"{args.input_db}: cannot open LMDB: {e}") from None
    total, count = None, 0
    log.info("Starting Iteration")
    try:
        with env.begin() as txn:
            for key, value in txn.cursor():
                where = f"{args.input_db}: record {key!r}"
                image, _ = datum_image(value, "unchanged", where)
                if total is None:
                    total = np.zeros(image.shape, np.float32)
                elif image.shape != total.shape:
                    raise DataError(f"{where}: Incorrect data field size: image is {image.shape}, the first was "
                                    f"{total.shape} (channels x height x width)")
                total += image.astype(np.float32)
                count += 1
                if count % 10000 == 0:
                    log.info("Processed %d files.", count)
    finally:
        env.close()
    if total is None:
        raise DataError(f"{args.input_db}: the database is empty")
    if count % 10000:
        log.info("Processed %d files.", count)
    mean = total / np.float32(count)
    channels, height, width = mean.shape
    if args.output_file:
        log.info("Write to %s", args.output_file)
        blob = caffe_pb2.BlobProto(num=1, channels=channels, height=height, width=width)
        blob.data.extend(mean.ravel().tolist())
        atomic_write(args.output_file, blob.SerializeToString())
    log.info("Number of channels: %d", channels)
    dim = np.float32(height * width)
    for c in range(channels):
        # Caffe adds the channel's values one by one into a float and divides that by the pixel count in float:
        # cumsum sums in that order (np.sum's pairwise sum is closer to the true mean, so it printed another
        # 6th digit for big images).
        channel_sum = np.cumsum(mean[c].ravel(), dtype=np.float32)[-1]
        log.info("mean_value channel [%d]: %s", c, log_float(channel_sum / dim))
    return 0


# ---- extract-features ---------------------------------------------------------------------------------------

KEY_DIGITS = 10  # caffe::format_int(index, 10)


def _device_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"DEVICE_ID is a device number (0, 1, ...), got '{text}'")
    return value


def extract_features(args) -> int:
    """Caffe's extract_features: for each of NUM_MINI_BATCHES forwards, each named blob's items, one Datum per
    image (float_data; channels, height and width are the blob's legacy shape), go to that blob's new database
    under the image's index. Transactions commit every 1000 records. Caffe logs its progress as errors (so
    that it shows without --logtostderr); so does this."""
    import caffejax
    from caffejax.cli.nets import _model_file, _use_gpu_flag

    if args.device == "GPU":
        log.error("Using GPU")
        log.error("Using Device_id=%d", args.device_id)
        args.gpu = [args.device_id]
        _use_gpu_flag(args)
    else:
        log.error("Using CPU")
    blob_names, dataset_names = args.blob_names.split(","), args.dataset_names.split(",")
    if len(blob_names) != len(dataset_names):
        raise CaffejaxError(f"the number of blob names ({len(blob_names)}) and dataset names ({len(dataset_names)}) "
                            "must be equal")
    _check_backend(args.db_type)
    net = caffejax.Net(_model_file(args.feature_extraction_proto), caffejax.TEST,
                       weights=args.pretrained_net_param, allow_python_layers=args.allow_python_layers)
    for name in blob_names:
        if name not in net.blobs:
            raise CaffejaxError(f"Unknown feature blob name {name} in the network {args.feature_extraction_proto}")
    for name in dataset_names:
        if os.path.exists(name):
            raise DataError(f"{name}: already exists; extract-features creates a new database")
    lmdb = _lmdb()
    envs, txns = [], []
    try:
        for name in dataset_names:
            log.info("Opening dataset %s", name)
            envs.append(lmdb.open(name, map_size=LMDB_MAP_SIZE))
            txns.append(envs[-1].begin(write=True))
        log.error("Extacting Features")  # sic: Caffe's words
        counts = [0] * len(blob_names)
        for _ in range(args.num_mini_batches):
            blobs = net.forward(blobs=blob_names)
            for i, name in enumerate(blob_names):
                for record in _feature_records(name, np.asarray(blobs[name])):
                    txns[i].put(f"{counts[i]:0{KEY_DIGITS}d}".encode(), record)
                    counts[i] += 1
                    if counts[i] % COMMIT_EVERY == 0:
                        txns[i].commit()
                        txns[i] = envs[i].begin(write=True)
                        log.error("Extracted features of %d query images for feature blob %s", counts[i], name)
        for i, name in enumerate(blob_names):
            txns[i].commit()
            log.error("Extracted features of %d query images for feature blob %s", counts[i], name)
        txns = []
    finally:
        for txn in txns:
            txn.abort()
        for env in envs:
            env.close()
    log.error("Successfully extracted the features!")
    return 0


def _feature_records(name: str, values: np.ndarray):
    """One serialized Datum per item of a blob (its first axis): float_data the item's values; channels, height
    and width the blob's LegacyShape(1..3), 1 past its axes, as Caffe's accessors give them."""
    from caffejax.lower.registry import legacy_4d
    from caffejax.proto import caffe_pb2

    if values.ndim > 4:
        raise CaffejaxError(f"feature blob {name} has {values.ndim} axes {values.shape}: Caffe stores a blob's "
                            "legacy channels x height x width, and a blob of more than 4 axes has none")
    legacy = legacy_4d(values.shape)
    rows = values.astype(np.float32, copy=False).reshape(legacy[0], -1)
    for row in rows:
        datum = caffe_pb2.Datum(channels=legacy[1], height=legacy[2], width=legacy[3])
        datum.float_data.extend(row.tolist())
        yield datum.SerializeToString()
