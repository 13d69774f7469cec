"""caffejax.runtime.memory: the opt-in that lets malloc keep freed memory (process-wide, so in a child)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from caffejax.runtime import memory


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_keep_freed_memory_takes_effect_and_nets_still_run():
    code = ("import caffejax, numpy as np\n"
            "from caffejax.runtime import memory\n"
            "assert memory.keep_freed_memory()\n"
            "net = caffejax.Net('caffejax/models/lenet/lenet.prototxt', 'caffejax/models/lenet/"
            "lenet_iter_10000.caffemodel', caffejax.TEST)\n"
            "out = caffejax.compile_inference(net)({'data': np.zeros((64, 1, 28, 28), np.float32)})['prob']\n"
            "assert out.shape == (64, 10)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, memory.ENVIRONMENT: "1"})
    assert done.returncode == 0, done.stderr[-3000:]


def test_environment_switch(monkeypatch):
    monkeypatch.setenv(memory.ENVIRONMENT, "0")
    assert memory.apply_environment() is False
    monkeypatch.delenv(memory.ENVIRONMENT)
    assert memory.apply_environment() is False
