"""Images as Caffe's data layers see them: OpenCV's ``imread``/``imdecode`` and ``cv::resize`` (INTER_LINEAR),
done with Pillow and NumPy.

OpenCV hands Caffe an H x W x C uint8 array with colour channels in **BGR** order (BGRA with alpha), or one
channel for grayscale. The three read modes Caffe uses:

- ``"color"`` (IMREAD_COLOR): always 3 channels, BGR; alpha is dropped, gray is replicated.
- ``"gray"`` (IMREAD_GRAYSCALE): 1 channel, Y = 0.299 R + 0.587 G + 0.114 B.
- ``"unchanged"`` (IMREAD_UNCHANGED, used for encoded Datums without force_color/force_gray): the file's own
  channels: 1 for gray, 3 (BGR), or 4 (BGRA) when it has alpha.
"""

from __future__ import annotations

import io

import numpy as np

from caffejax.errors import DataError

READ_MODES = ("color", "gray", "unchanged")
_SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I")


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise DataError("decoding images needs Pillow: pip install 'caffejax[data]'") from None
    return Image


def decode_image(data: bytes, mode: str, where: str) -> np.ndarray:
    """Decode an encoded image (PNG, JPEG, ...) like ``cv::imdecode``: H x W x C uint8, channels BGR(A)."""
    Image = _pillow()
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return _as_opencv(im, mode, where)
    except DataError:
        raise
    except Exception as e:  # Pillow raises many types for truncated or unknown data
        raise DataError(f"{where}: cannot decode image ({type(e).__name__}: {e})") from None


def read_image(path: str, mode: str) -> np.ndarray:
    """``cv::imread``: the file at ``path`` decoded as :func:`decode_image` does."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DataError(f"Could not open or find file {path}: {e.strerror}") from None
    return decode_image(data, mode, path)


def _as_opencv(im, mode: str, where: str) -> np.ndarray:
    if mode not in READ_MODES:
        raise ValueError(f"read mode {mode!r} is not one of {READ_MODES}")
    if im.mode in _SIXTEEN_BIT:
        if mode == "unchanged":
            raise DataError(f"{where}: 16-bit image; Caffe's DataTransformer takes 8-bit images only")
        # OpenCV reduces 16-bit samples to 8 bits by keeping the high byte.
        gray = (np.asarray(im).astype(np.uint32) >> 8).astype(np.uint8)[:, :, None]
        return np.repeat(gray, 3, axis=2) if mode == "color" else gray
    if mode == "gray":
        return np.asarray(im.convert("L"))[:, :, None]
    if mode == "unchanged" and im.mode in ("L", "1"):
        return np.asarray(im.convert("L"))[:, :, None]
    with_alpha = im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info)
    if mode == "unchanged" and with_alpha:
        rgba = np.asarray(im.convert("RGBA"))
        return np.ascontiguousarray(rgba[:, :, [2, 1, 0, 3]])
    return np.ascontiguousarray(np.asarray(im.convert("RGB"))[:, :, ::-1])


# ---- cv::resize(INTER_LINEAR) ------------------------------------------------------------------------------
# OpenCV maps destination pixel centres onto the source (x_src = (x + 0.5) * src/dst - 0.5), clamps at the
# borders, and for 8-bit images blends with 11-bit fixed-point weights in two passes (rows, then columns).
# This is its reference (scalar) arithmetic; its SIMD kernels round the vertical pass slightly differently,
# so some pixels may differ from an OpenCV build by one gray level.

_COEF_BITS = 11
_COEF_SCALE = 1 << _COEF_BITS


def _linear_taps(src: int, dst: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per destination index: the two source indices and their fixed-point weights."""
    scale = src / dst
    f = ((np.arange(dst, dtype=np.float64) + 0.5) * scale - 0.5).astype(np.float32)
    i0 = np.floor(f).astype(np.int64)
    frac = (f - i0.astype(np.float32)).astype(np.float32)
    frac[i0 < 0] = 0
    i0[i0 < 0] = 0
    past = i0 >= src - 1
    frac[past] = 0
    i0[past] = src - 1
    i1 = np.minimum(i0 + 1, src - 1)
    w0 = np.rint((np.float32(1) - frac) * _COEF_SCALE).astype(np.int64)
    w1 = np.rint(frac * _COEF_SCALE).astype(np.int64)
    return i0, i1, w0, w1


def resize_linear(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """``cv::resize(image, (width, height), INTER_LINEAR)`` for an H x W x C uint8 image."""
    src_h, src_w = image.shape[:2]
    if (src_h, src_w) == (height, width):
        return image.copy()
    x0, x1, a0, a1 = _linear_taps(src_w, width)
    y0, y1, b0, b1 = _linear_taps(src_h, height)
    pixels = image.astype(np.int64)
    rows = pixels[:, x0] * a0[None, :, None] + pixels[:, x1] * a1[None, :, None]
    out = rows[y0] * b0[:, None, None] + rows[y1] * b1[:, None, None]
    out = (out + (1 << (2 * _COEF_BITS - 1))) >> (2 * _COEF_BITS)
    return np.clip(out, 0, 255).astype(np.uint8)
