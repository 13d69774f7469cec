"""Importing caffejax runs CPU programs on the calling thread, as Caffe does, unless the user opted out or JAX
had already started (process-wide, so each case in a fresh interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from caffejax.runtime import mode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENET = ("net = caffejax.Net('caffejax/models/lenet/lenet.prototxt', "
         "'caffejax/models/lenet/lenet_iter_10000.caffemodel', caffejax.TEST)\n"
         "x = np.random.default_rng(0).random((64, 1, 28, 28), dtype=np.float32)\n"
         "net.blobs['data'].data[...] = x\n"
         "blobs = net.forward()\n"
         "served = caffejax.compile_inference(net)({'data': x})['prob']\n"
         "assert np.allclose(served, blobs['prob'], rtol=1e-5, atol=1e-7)\n")


def _async_dispatch_after(prelude: str, environment: dict[str, str]) -> str:
    code = (prelude + "import caffejax, jax, numpy as np\n" + LENET +
            "print(jax.config.values['jax_cpu_enable_async_dispatch'])\n")
    env = {k: v for k, v in os.environ.items() if k != mode.ASYNC_DISPATCH_ENVIRONMENT}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**env, **environment})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()[-1]


@pytest.mark.parametrize("prelude, environment, expected", [
    ("", {}, "False"),                                                   # caffejax's default: inline
    ("", {mode.ASYNC_DISPATCH_ENVIRONMENT: "1"}, "True"),                # the user's opt-out
    ("", {mode.ASYNC_DISPATCH_ENVIRONMENT: "0"}, "False"),
    ("import jax\njax.devices()\n", {}, "True"),                         # JAX already started: left alone
], ids=["default", "opt-out", "opt-out-0", "jax-started-first"])
def test_cpu_dispatch_on_import(prelude, environment, expected):
    assert _async_dispatch_after(prelude, environment) == expected


@pytest.mark.parametrize("value,expected", [("1", True), (" On ", True), ("YES", True), ("true", True),
                                            ("0", False), ("off", False), (" No", False), ("FALSE", False),
                                            ("", None), ("2", None), ("/some/path", None)])
def test_environment_switch_reads_the_words_every_caffejax_switch_takes(monkeypatch, value, expected):
    monkeypatch.setenv("CAFFEJAX_TEST_SWITCH", value)
    assert mode.environment_switch("CAFFEJAX_TEST_SWITCH") is expected
    monkeypatch.delenv("CAFFEJAX_TEST_SWITCH")
    assert mode.environment_switch("CAFFEJAX_TEST_SWITCH") is None
