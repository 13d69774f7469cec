#!/usr/bin/env bash
# The accelerator check, prepared for one call of the device tool (a session gets 15 minutes of device time,
# the machine's start included, so there is no room for a second try):
#
#     run(command="bash bench/device_check.sh", timeout_s=560)          # carry=[".device"] if it exists
#
# What comes back under $OUT: env.txt (versions, devices), tests.log (the Caffe-parity tests, run on the
# accelerator), bench.log and bench.json (python -m bench.run there: fp32 and bf16 inference and the training
# step; without OpenCV, which only runs on the host's CPU, and without the fresh-process start-up runs).
#
# The machine's image has JAX with CUDA, pytest and h5py, but its own protobuf, and caffejax's caffe_pb2 needs
# protobuf >= 6.33.5. Where that import fails, wheels in .device/wheels (ignored by git; name .device in carry)
# are installed into .device/site. Fetch them on the development machine first:
#     pip download 'protobuf>=6.33.5,<7' --only-binary=:all: --python-version 3.12 \
#         --platform manylinux2014_x86_64 -d .device/wheels
# Knobs: NETS (comma-separated bench nets; default all six), BATCHES (default 1,16), TEST_SECONDS (150),
# BENCH_SECONDS (300).
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=python3

if ! $py -c "import caffejax" 2>"$OUT/import.err"; then
  if [ -d .device/wheels ]; then
    $py -m pip install -q --no-index --find-links .device/wheels --target .device/site protobuf
    export PYTHONPATH="$PWD/.device/site:$PYTHONPATH"
  fi
  $py -c "import caffejax" || { echo "caffejax does not import:"; cat "$OUT/import.err"; exit 1; }
fi

$py - <<'PY' | tee "$OUT/env.txt"
import google.protobuf, jax, jaxlib, numpy
print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "numpy", numpy.__version__,
      "protobuf", google.protobuf.__version__)
print("backend", jax.default_backend(), "devices", jax.devices())
PY
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null | tee -a "$OUT/env.txt"

echo "== Caffe-parity tests on $($py -c 'import jax; print(jax.default_backend())')"
timeout "${TEST_SECONDS:-150}" $py -m pytest -q -x -p no:cacheprovider tests/test_reference.py tests/test_solver.py \
  >"$OUT/tests.log" 2>&1
echo "pytest exit $? (124: stopped at TEST_SECONDS)"; tail -3 "$OUT/tests.log"

echo "== bench"
bench_args=(--no-opencv --no-coldstart --batches "${BATCHES:-1,16}" --out "$OUT/bench.json")
[ -n "${NETS:-}" ] && bench_args+=(--nets "$NETS")
timeout "${BENCH_SECONDS:-300}" $py -m bench.run "${bench_args[@]}" >"$OUT/bench.log" 2>&1
echo "bench exit $? (124: stopped at BENCH_SECONDS; bench.json holds every net finished)"
tail -25 "$OUT/bench.log"
