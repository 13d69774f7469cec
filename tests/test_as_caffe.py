"""python -m caffejax.as_caffe: a pycaffe script's own imports (``import caffe``, ``from caffe.proto import
caffe_pb2``, ``from caffe.coord_map import crop``...) get caffejax, in a process of its own."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

SCRIPT = '''
import sys
import numpy as np
import caffe
import caffe.draw
from caffe import layers as L, params as P
from caffe.proto import caffe_pb2
from caffe.coord_map import crop
from caffe.io import Transformer

n = caffe.NetSpec()
n.data = L.Input(shape=dict(dim=[2, 1, 8, 8]))
n.conv = L.Convolution(n.data, kernel_size=3, pad=1, num_output=2, weight_filler=dict(type="xavier"))
n.pool = L.Pooling(n.conv, kernel_size=2, stride=2, pool=P.Pooling.MAX)
proto = n.to_proto()
assert isinstance(proto, caffe_pb2.NetParameter)
net = caffe.Net(proto, caffe.TEST)
out = net.forward(data=np.ones((2, 1, 8, 8), np.float32))
print("argv", sys.argv[1:], "pool", out["pool"].shape, "draw", callable(caffe.draw.draw_net_to_file),
      "crop", callable(crop), "transformer", Transformer.__module__, "name", __name__)
'''


def _run(*args, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_a_pycaffe_script_runs_unchanged(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    done = _run("-m", "caffejax.as_caffe", "script.py", "--flag", "x", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert ("argv ['--flag', 'x'] pool (2, 2, 4, 4) draw True crop True transformer caffejax.io name __main__"
            in done.stdout)


def test_another_caffe_is_not_shadowed(tmp_path):
    (tmp_path / "caffe.py").write_text("REAL = True\n")
    code = ("import caffe, caffejax.as_caffe as a\n"
            "try:\n    a.install()\nexcept caffejax.CaffejaxError as e:\n    print('refused:', e)\n")
    done = _run("-c", "import caffejax\n" + code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "refused: another 'caffe' module is already imported" in done.stdout
