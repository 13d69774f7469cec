"""caffejax.runtime.memory: malloc keeps freed memory, as importing caffejax sets up unless the environment opts
out (process-wide, so in a child)."""

from __future__ import annotations

import gc
import os
import platform
import subprocess
import sys

import pytest

from caffejax.runtime import memory

GLIBC = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")


@GLIBC
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


# A child that frees a 256 MB array: its resident set stays up where malloc keeps freed memory, and drops
# back where glibc unmaps the block on free (its default for blocks over the mmap threshold).
FREED_AND_KEPT = ("import caffejax, numpy as np\n"
                  "def resident(): return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
                  "before = resident()\n"
                  "a = np.ones(2 ** 25)\n"
                  "del a\n"
                  "print(resident() - before > 2 ** 27)\n")


@GLIBC
@pytest.mark.parametrize("setting, kept", [(None, "True"), ("0", "False"), ("off", "False"), ("1", "True")])
def test_importing_caffejax_keeps_freed_memory_unless_opted_out(setting, kept):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != memory.ENVIRONMENT}
    if setting is not None:
        env[memory.ENVIRONMENT] = setting
    done = subprocess.run([sys.executable, "-c", FREED_AND_KEPT], cwd=root, capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == kept


def test_environment_switch(monkeypatch):
    for off in ("0", "false", "off", "no"):
        monkeypatch.setenv(memory.ENVIRONMENT, off)
        assert memory.apply_environment() is False


@pytest.mark.parametrize("enabled", [True, False])
def test_garbage_collection_paused_turns_the_collector_off_and_back_to_how_it_was(enabled):
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with memory.garbage_collection_paused():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(RuntimeError), memory.garbage_collection_paused():
            raise RuntimeError("a failed build")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_an_inference_program_is_built_with_the_collector_paused(monkeypatch):
    import numpy as np

    import caffejax
    from caffejax.runtime import inference
    from conftest import BUNDLED

    seen = []
    prepare = inference.prepare_params

    def spy(*args):
        seen.append(gc.isenabled())
        return prepare(*args)

    monkeypatch.setattr(inference, "prepare_params", spy)
    net = caffejax.Net(str(BUNDLED / "lenet/lenet.prototxt"), str(BUNDLED / "lenet/lenet_iter_10000.caffemodel"),
                       caffejax.TEST)
    assert gc.isenabled()
    infer = caffejax.compile_inference(net)
    out = infer({"data": np.zeros((2, 1, 28, 28), np.float32)})["prob"]
    infer({"data": np.zeros((2, 1, 28, 28), np.float32)})  # the same program: no second build
    assert out.shape == (2, 10) and seen == [False] and gc.isenabled()
