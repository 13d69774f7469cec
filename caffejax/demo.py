"""The demo: compile and run real trained Caffe models bundled with caffejax.

``python -m caffejax.demo`` loads LeNet (trained on MNIST, from ethereon/caffe-tensorflow) and the four
MTCNN face-detection nets (kpzhang93), compiles each with XLA, runs a batch, and prints what came out, how
long compilation took and how long one batch takes once compiled.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import numpy as np

MODELS = pathlib.Path(__file__).resolve().parent / "models"


def draw_digits() -> tuple[np.ndarray, list[int]]:
    """A few digits drawn with strokes on a 28x28 canvas, white on black, scaled as LeNet was trained (x/256)."""
    canvas = np.zeros((4, 1, 28, 28), np.float32)
    yy, xx = np.mgrid[0:28, 0:28]
    canvas[0, 0, 4:24, 13:16] = 1.0                                   # 1: a vertical bar
    canvas[1, 0, 5:8, 7:21] = 1.0                                     # 7: a top bar ...
    for t in np.linspace(0, 1, 60):                                   # ... and a diagonal
        y, x = int(7 + 16 * t), int(19 - 8 * t)
        canvas[1, 0, y:y + 2, x:x + 3] = 1.0
    ring = np.abs(np.hypot((yy - 14) / 9.0, (xx - 14) / 6.0) - 1.0) < 0.18
    canvas[2, 0][ring] = 1.0                                          # 0: an ellipse
    canvas[3, 0, 4:7, 8:20] = 1.0                                     # 4: ... drawn as two strokes and a bar
    canvas[3, 0, 4:16, 8:11] = 1.0
    canvas[3, 0, 14:17, 8:21] = 1.0
    canvas[3, 0, 4:24, 17:20] = 1.0
    return canvas * (255.0 / 256.0), [1, 7, 0, 4]


def run_net(name: str, prototxt: pathlib.Path, weights: pathlib.Path, inputs: dict[str, np.ndarray],
            repeats: int = 20) -> dict[str, np.ndarray]:
    import caffejax

    t0 = time.perf_counter()
    net = caffejax.Net(str(prototxt), caffejax.TEST, weights=str(weights))
    load_s = time.perf_counter() - t0
    for blob, array in inputs.items():
        net.blobs[blob].reshape(*array.shape)
    t0 = time.perf_counter()
    out = net.forward(**inputs)
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        net.forward(**inputs)
        times.append(time.perf_counter() - t0)
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in sorted(out.items()))
    print(f"{name:>10}: {len(net.layers)} layers, loaded in {load_s * 1e3:.0f} ms, first forward (compile) "
          f"{first_s * 1e3:.0f} ms, then {np.median(times) * 1e3:.2f} ms per batch "
          f"(compiled {net.compile_count}x); outputs: {shapes}")
    return out


def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in np.ravel(values)) + "]"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed forwards per net")
    args = parser.parse_args(argv)

    import jax

    print(f"caffejax demo on {jax.devices()[0].platform.upper()} ({jax.device_count()} device(s))")
    digits, truth = draw_digits()
    out = run_net("LeNet", MODELS / "lenet" / "lenet.prototxt", MODELS / "lenet" / "lenet_iter_10000.caffemodel",
                  {"data": digits}, args.repeats)
    predicted = out["prob"].reshape(len(truth), -1).argmax(axis=1).tolist()
    print(f"            drawn digits {truth} -> LeNet predicts {predicted}; "
          f"confidence {_fmt(out['prob'].reshape(len(truth), -1).max(axis=1))}")

    rng = np.random.default_rng(0)
    # MTCNN takes (pixel - 127.5) / 128 images, transposed to (N, C, W, H) as its authors fed it.
    for name, size, batch in (("det1", (3, 48, 64), 1), ("det2", (3, 24, 24), 8), ("det3", (3, 48, 48), 8),
                              ("det4", (15, 24, 24), 4)):
        image = ((rng.integers(0, 256, (batch,) + size) - 127.5) / 128.0).astype(np.float32)
        out = run_net(f"MTCNN {name}", MODELS / "mtcnn" / f"{name}.prototxt", MODELS / "mtcnn" / f"{name}.caffemodel",
                      {"data": image}, args.repeats)
        if "prob1" in out:
            face = out["prob1"].reshape(batch, 2, -1)[:, 1].max(axis=-1)
            print(f"            face probability on random noise (should be low): {_fmt(face)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
