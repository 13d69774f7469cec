#!/usr/bin/env bash
# The accelerator check, prepared for one call of the device tool (a session gets 15 minutes of device time,
# the machine's start included, so there is no room for a second try):
#
#     run(command="bash bench/device_check.sh", timeout_s=560)          # carry=[".device"] if it exists
#
# Sizes seen on an H200 (2026-12-04, JAX 0.11.2): the versions and ceilings ~40 s; the parity tests, 497 of
# them on 8 workers, ~130 s; the bench is compile-bound there: ResNet-50 at batch 1 and 16 took 5 minutes
# (training programs compiled in 68-88 s, inference in 1.6-12.5 s), GoogLeNet at batch 16 alone 100 s, and
# MobileNet v2's batch-16 inference had not compiled after 2 minutes. One lease covers about two nets: pick them
# with NETS (and BATCHES), most wanted first, and BENCH_ARGS (say "--no-solver --no-bf16") to leave parts out.
# Still open there: whether XLA's autotuning is the compile time, and what it buys at run time. COMPILE_AB=
# "resnet50:16" answers it before the bench: python -m bench.compile_ab compiles that net's training step in
# fresh processes, as the image has XLA_FLAGS and with --xla_gpu_autotune_level=0 (compile_ab.log).
#
# What comes back under $OUT: env.txt (versions, devices), tests.log (the Caffe-parity tests, run on the
# accelerator), bench.log and bench.json (python -m bench.run there: fp32 and bf16 inference and the training
# step; without OpenCV, which only runs on the host's CPU, and without the fresh-process start-up runs).
#
# The machine's image has JAX with CUDA, pytest, h5py and flax, but its own protobuf (caffejax's caffe_pb2
# needs >= 6.33.5) and no lmdb. Wheels in .device/wheels (ignored by git; name .device in carry) are installed
# into /tmp/site, ahead of the image's packages. Fetch them on the development machine first:
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .device/wheels \
#         'protobuf>=6.33.5,<7' lmdb
# Knobs: NETS (comma-separated bench nets; default all six), BATCHES (default 1,16), TEST_SECONDS (150),
# TEST_WORKERS (8), BENCH_SECONDS (300), GEMM_N (the ceilings' matrix size, 8192), BENCH_ARGS (more bench.run flags),
# COMPILE_AB (net:batch, unset: skipped), COMPILE_AB_SECONDS (the compile A/B's limit, 400), SKIP_TESTS=1.
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=python3

# Carried wheels (protobuf >= 6.33.5 for caffe_pb2, lmdb for the data-layer tests) go first on the path.
for wheel in .device/wheels/*.whl; do
  [ -e "$wheel" ] || continue
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheel" \
    || echo "not installed: $wheel"
done
[ -d /tmp/site ] && export PYTHONPATH="/tmp/site:$PYTHONPATH"
$py -c "import caffejax" 2>"$OUT/import.err" || { echo "caffejax does not import:"; cat "$OUT/import.err"; exit 1; }

$py - <<'PY' | tee "$OUT/env.txt"
import google.protobuf, jax, jaxlib, numpy
print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "numpy", numpy.__version__,
      "protobuf", google.protobuf.__version__)
print("backend", jax.default_backend(), "devices", jax.devices())
# The device's own ceilings, measured in this call: 8192^2 products at fp32 (full precision and XLA's
# default, TF32 on tensor cores) and bf16 with fp32 accumulation.
import time, jax.numpy as jnp
import os
n = int(os.environ.get("GEMM_N", 8192))
a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
for label, dtype, precision in [("fp32 HIGHEST", jnp.float32, "highest"), ("fp32 DEFAULT", jnp.float32, "default"),
                                ("bf16", jnp.bfloat16, "default")]:
    x = a.astype(dtype)
    f = jax.jit(lambda x: jnp.matmul(x, x, precision=precision, preferred_element_type=jnp.float32))
    f(x).block_until_ready()
    times = []
    for _ in range(10):
        t = time.perf_counter(); f(x).block_until_ready(); times.append(time.perf_counter() - t)
    print(f"matmul {n}^2 {label}: {2 * n ** 3 / sorted(times)[5] / 1e12:.1f} TFLOP/s (median of 10)")
PY
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null | tee -a "$OUT/env.txt"

if [ -n "${COMPILE_AB:-}" ]; then
  echo "== training-step compile A/B: ${COMPILE_AB}"
  timeout "${COMPILE_AB_SECONDS:-400}" $py -m bench.compile_ab "${COMPILE_AB%%:*}" --batch "${COMPILE_AB##*:}" \
    --flags=--xla_gpu_autotune_level=0 --timeout 190 >"$OUT/compile_ab.log" 2>&1
  echo "compile_ab exit $?"; tail -4 "$OUT/compile_ab.log"
fi

[ "${SKIP_TESTS:-0}" = 1 ] || {
echo "== Caffe-parity tests on $($py -c 'import jax; print(jax.default_backend())')"
# Several workers share the one GPU (tests/conftest.py has each take memory as it needs it).
timeout "${TEST_SECONDS:-150}" $py -m pytest -v -rfE -n "${TEST_WORKERS:-8}" \
  -p no:cacheprovider tests/test_reference.py tests/test_solver.py >"$OUT/tests.log" 2>&1
echo "pytest exit $? (124: stopped at TEST_SECONDS)"; grep -E "FAILED|ERROR" "$OUT/tests.log" | head -40
# The tally of the -v lines, which stands even where the timeout came before pytest's own summary.
echo "tests reported: $(grep -oE '^\[gw[0-9]+\] \[ *[0-9]+%\] [A-Z]+' "$OUT/tests.log" | awk '{print $NF}' | sort | uniq -c | xargs)"
tail -1 "$OUT/tests.log"
}

echo "== bench"
bench_args=(--no-opencv --no-coldstart --batches "${BATCHES:-1,16}" --out "$OUT/bench.json" ${BENCH_ARGS:-})
[ -n "${NETS:-}" ] && bench_args+=(--nets "$NETS")
timeout "${BENCH_SECONDS:-300}" $py -m bench.run "${bench_args[@]}" >"$OUT/bench.log" 2>&1
echo "bench exit $? (124: stopped at BENCH_SECONDS; bench.json holds every net finished)"
tail -25 "$OUT/bench.log"
