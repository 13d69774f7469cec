"""MTCNN (kpzhang93's face detector, the bundled demo model) as a detector runs it on one photo: P-Net (det1)
over an image pyramid, then R-Net (det2), O-Net (det3) and L-Net (det4) on batches of candidate crops. Each net
runs through caffejax's ``compile_inference`` and through OpenCV DNN on the same prototxt and weights, in
alternating blocks of the same run.

    python -m bench.mtcnn                                # a 480 x 640 photo, faces from 20 pixels
    python -m bench.mtcnn --height 720 --width 1280 --min-face 40 --json out.json

The pyramid is detect_face's: scales 12/min_face x factor^k while the image's shorter side stays >= 12 pixels
at that scale, each level ceil(h x scale) x ceil(w x scale), fed as MTCNN's authors fed it, (1, 3, W, H). The
crops' counts depend on the photo; the defaults are a few faces' worth. Prints each program's median ms, its
ratio to OpenCV's, the largest difference of its outputs from OpenCV's, and the totals: the pyramid, and the
whole detection (pyramid and the three batches; the host work between the stages, non-maximum suppression and
cropping, is not timed). The first photo pays one compile per new shape: its seconds are printed too. Inputs
are random values in MTCNN's range, [-1, 1]. A benchmark, never a test.

Then the pyramid walked whole, level after level, three ways in alternating blocks: compile_inference, the
pycaffe script's way (``net.blobs['data'].reshape(...)``, ``data[...] =``, ``net.forward()`` at each level, as
detect_face runs it through ``import caffejax as caffe``), and OpenCV.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time

import numpy as np

from bench.nets import ROOT

MODELS = ROOT / "caffejax" / "models" / "mtcnn"
CROPS = {"det2": (3, 24, 24), "det3": (3, 48, 48), "det4": (15, 24, 24)}  # (C, W, H) of one crop


def pyramid_shapes(height: int, width: int, min_face: int = 20, factor: float = 0.709) -> list[tuple[int, ...]]:
    """det1's input shapes for a height x width photo, largest first: detect_face's scales, each level fed as
    (1, 3, W, H)."""
    shapes = []
    scale, shorter = 12 / min_face, min(height, width) * 12 / min_face
    while shorter >= 12:
        shapes.append((1, 3, math.ceil(width * scale), math.ceil(height * scale)))
        scale *= factor
        shorter *= factor
    return shapes


def _compiled_and_opencv(name: str):
    """One MTCNN net as caffejax's compile_inference and as OpenCV DNN's net."""
    import caffejax
    from bench.run import opencv_net

    prototxt, weights = MODELS / f"{name}.prototxt", MODELS / f"{name}.caffemodel"
    return (caffejax.compile_inference(caffejax.Net(str(prototxt), caffejax.TEST, weights=str(weights))),
            opencv_net(prototxt, weights))


def _programs(name: str, shapes, repeats: int, rng, nets=None) -> list[dict]:
    """Each shape of one net, caffejax against OpenCV (alternating blocks): medians, ratio, agreement. ``nets``:
    the net's (compile_inference, OpenCV) pair, made here where not given."""
    from bench.measure import once, timed_alternating

    infer, dnn = nets or _compiled_and_opencv(name)
    rows = []
    for shape in shapes:
        x = rng.uniform(-1, 1, shape).astype(np.float32)
        outputs, first = once(lambda: infer({"data": x}))
        names = list(outputs)

        def opencv():
            dnn.setInput(x)
            return dnn.forward(names)

        difference = max(float(np.abs(np.asarray(outputs[n]) - o).max()) for n, o in zip(names, opencv()))
        times = timed_alternating({"caffejax": lambda: infer({"data": x}), "opencv": opencv}, repeats,
                                  min_seconds=0.2)
        rows.append({"net": name, "shape": list(shape), "first_s": first, "max_abs_diff": difference,
                     **{f"{k}_ms": v["median_ms"] for k, v in times.items()},
                     "ratio": times["caffejax"]["median_ms"] / times["opencv"]["median_ms"]})
        print(f"  {name} {'x'.join(map(str, shape)):>14}  caffejax {rows[-1]['caffejax_ms']:8.3f} ms  OpenCV "
              f"{rows[-1]['opencv_ms']:8.3f} ms  ratio {rows[-1]['ratio']:5.2f}  first call {first:5.2f} s  "
              f"max |diff| {difference:.1e}", flush=True)
    return rows


def _pyramid_walks(shapes, repeats: int, rng, nets) -> dict:
    """det1 over every level in turn, per walk: compile_inference, Net.forward as a pycaffe script calls it
    (reshaping its input blob at each level) and OpenCV, in alternating blocks; medians, ratios to OpenCV's, and
    the largest difference of the pycaffe way's outputs from OpenCV's. ``nets``: det1's (compile_inference,
    OpenCV) pair that timed its levels one by one (its programs compiled already)."""
    import caffejax
    from bench.measure import timed_alternating

    infer, dnn = nets
    net = caffejax.Net(str(MODELS / "det1.prototxt"), str(MODELS / "det1.caffemodel"), caffejax.TEST)
    xs = [rng.uniform(-1, 1, shape).astype(np.float32) for shape in shapes]
    names = ["conv4-2", "prob1"]

    def compiled():
        return [infer({"data": x}) for x in xs]

    def pycaffe():
        outputs = []
        for x in xs:
            net.blobs["data"].reshape(*x.shape)
            net.blobs["data"].data[...] = x
            out = net.forward()
            outputs.append([out[name].copy() for name in names])
        return outputs

    def opencv():
        outputs = []
        for x in xs:
            dnn.setInput(x)
            outputs.append(dnn.forward(names))
        return outputs

    difference = max((float(np.abs(a - b).max()) for mine, theirs in zip(pycaffe(), opencv())
                      for a, b in zip(mine, theirs)), default=0.0)
    times = timed_alternating({"compile_inference": compiled, "net_forward": pycaffe, "opencv": opencv},
                              repeats, min_seconds=0.5)
    walk = {f"{k}_ms": v["median_ms"] for k, v in times.items()}
    walk.update({f"{k}_ratio": walk[f"{k}_ms"] / walk["opencv_ms"] for k in ("compile_inference", "net_forward")})
    walk["net_forward_max_abs_diff"] = difference
    print(f"pyramid walked level after level: compile_inference {walk['compile_inference_ms']:8.3f} ms (ratio "
          f"{walk['compile_inference_ratio']:5.2f})  Net.forward as pycaffe scripts call it "
          f"{walk['net_forward_ms']:8.3f} ms (ratio {walk['net_forward_ratio']:5.2f}, max |diff| {difference:.1e})  "
          f"OpenCV {walk['opencv_ms']:8.3f} ms")
    return walk


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--min-face", type=int, default=20)
    parser.add_argument("--factor", type=float, default=0.709)
    parser.add_argument("--crops", default="det2:32,det3:8,det4:4",
                        help="each later stage's batch of crops, net:count (count 0 leaves it out)")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--json", help="write the rows and totals here")
    args = parser.parse_args(argv)
    try:
        import cv2
    except ImportError:
        from bench.run import OPENCV_MISSING

        raise SystemExit(OPENCV_MISSING) from None
    import jax

    rng = np.random.default_rng(0)
    shapes = pyramid_shapes(args.height, args.width, args.min_face, args.factor)
    print(f"MTCNN on a {args.height} x {args.width} photo, faces from {args.min_face} px: {len(shapes)} pyramid "
          f"levels; caffejax (JAX {jax.__version__}, {jax.default_backend()}) against OpenCV {cv2.__version__} "
          f"({cv2.getNumThreads()} threads)")
    det1 = _compiled_and_opencv("det1")
    rows = _programs("det1", shapes, args.repeats, rng, det1)
    for item in filter(None, args.crops.split(",")):
        name, count = item.split(":")
        if int(count):
            rows += _programs(name, [(int(count),) + CROPS[name]], args.repeats, rng)
    pyramid = [row for row in rows if row["net"] == "det1"]
    totals = {}
    for label, part in (("pyramid", pyramid), ("detection", rows)):
        totals[label] = {key: sum(row[key] for row in part) for key in ("caffejax_ms", "opencv_ms", "first_s")}
        totals[label]["ratio"] = totals[label]["caffejax_ms"] / totals[label]["opencv_ms"]
        t = totals[label]
        print(f"{label:>9}: caffejax {t['caffejax_ms']:8.3f} ms  OpenCV {t['opencv_ms']:8.3f} ms  ratio "
              f"{t['ratio']:5.2f}  first photo {t['first_s']:5.2f} s (compiles included)")
    walk = _pyramid_walks(shapes, max(1, args.repeats // 2), rng, det1) if shapes else None
    if args.json:
        report = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "jax": jax.__version__,
                  "opencv": cv2.__version__, "rows": rows, "totals": totals, "pyramid_walk": walk}
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
