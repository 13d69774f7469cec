"""pyproject.toml's dependencies: what pip may resolve on each Python, and what this environment holds."""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"


def declared_dependencies() -> list[Requirement]:
    return [Requirement(text) for text in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]]


def allowed(name: str, version: str, python: str) -> bool:
    """Whether pip may install ``name`` at ``version`` for caffejax on Python ``python`` ("3.11")."""
    environment = {"python_version": python, "python_full_version": f"{python}.0"}
    return all(requirement.specifier.contains(version, prereleases=True) for requirement in declared_dependencies()
               if requirement.name == name and (requirement.marker is None or requirement.marker.evaluate(environment)))


def test_python_3_11_gets_an_ml_dtypes_its_numpy_imports_quickly():
    # ml_dtypes 0.7 registers ufunc loops that NumPy < 2.5 adds in quadratic time (0.5-0.75 s at every import of
    # JAX), and Python 3.11 gets no NumPy 2.5; 3.12 and later get NumPy 2.5, with which 0.7 imports quickly.
    assert not allowed("ml_dtypes", "0.7.0", "3.11")
    assert allowed("ml_dtypes", "0.6.0", "3.11")
    assert allowed("ml_dtypes", "0.7.0", "3.12")
    assert allowed("ml_dtypes", "0.7.0", "3.13")


def test_the_installed_packages_satisfy_the_declared_dependencies():
    for requirement in declared_dependencies():
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{requirement.name} is not installed (pyproject.toml: {requirement})")
        assert requirement.specifier.contains(installed, prereleases=True), (
            f"{requirement.name} {installed} is installed; pyproject.toml asks {requirement} "
            "(pip install -e . again)")


@pytest.mark.parametrize("collecting", [True, False])
def test_importing_caffejax_pauses_the_cyclic_collector_and_gives_it_back(collecting):
    # Its ~240 collections cost 0.05-0.1 s of each import; a script that turned the collector off keeps it off.
    script = ("import gc, json\n"
              "runs = []\n"
              "gc.callbacks.append(lambda phase, info: runs.append(info['generation']) if phase == 'start' else None)\n"
              f"{'' if collecting else 'gc.disable()'}\n"
              "import caffejax\n"
              "print(json.dumps([len(runs), gc.isenabled()]))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    runs, enabled = json.loads(out.strip().splitlines()[-1])
    assert enabled is collecting
    assert runs <= 5


def test_the_suite_holds_under_the_log_level_and_caches_a_shell_exports(tmp_path):
    """Caffe's users export GLOG_minloglevel=2 to quiet its log, and a shell may turn caffejax's program cache or
    JAX's persistent cache on for every process: the suite's checks of log lines and of compile counts still hold
    (conftest drops the three; the tests of each set their own). Two runs: without the drop, the second one would
    load its programs from the caches the first one filled."""
    tests = pathlib.Path(__file__).resolve().parent
    env = {**os.environ, "GLOG_minloglevel": "2", "CAFFEJAX_PROGRAM_CACHE": str(tmp_path / "programs"),
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax")}
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               f"{tests / 'test_cli.py'}::test_caffes_gpu_flag_is_accepted",
                               f"{tests / 'test_net_runtime.py'}::test_compiles_once_per_shape"],
                              env=env, capture_output=True, text=True, timeout=600, cwd=tests.parent)
        assert done.returncode == 0, done.stdout[-3000:]
