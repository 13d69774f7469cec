"""caffejax's program cache: compiled inference programs kept on disk and loaded without tracing."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import caffejax
from caffejax.runtime import program_cache
from conftest import BUNDLED

LENET = BUNDLED / "lenet/lenet.prototxt"
WEIGHTS = BUNDLED / "lenet/lenet_iter_10000.caffemodel"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(program_cache.ENVIRONMENT, str(tmp_path / "programs"))
    return tmp_path / "programs"


def _events(caplog) -> list[str]:
    return [r.getMessage().split()[-1] for r in caplog.records if r.name == program_cache.__name__]


def _digits(batch: int) -> np.ndarray:
    return np.random.default_rng(batch).random((batch, 1, 28, 28), dtype=np.float32)


def test_a_new_function_loads_the_program_and_reads_its_own_weights(cache, caplog):
    caplog.set_level(logging.DEBUG, logger=program_cache.__name__)
    net = caffejax.Net(str(LENET), str(WEIGHTS), caffejax.TEST)
    x = _digits(3)
    first = caffejax.compile_inference(net)({"data": x})["prob"]
    assert _events(caplog) == ["compiled"] and len(list(cache.glob("*.program"))) == 1
    again = caffejax.compile_inference(net)({"data": x})["prob"]
    assert _events(caplog) == ["compiled", "cache"]  # "... loaded from the cache"
    np.testing.assert_array_equal(np.asarray(again), np.asarray(first))
    # The weights are arguments of the program, not constants in it: other weights, same program, their output.
    net.params["ip2"][1].data[...] += 5.0 * np.arange(10, dtype=np.float32)
    edited = caffejax.compile_inference(net)({"data": x})["prob"]
    assert _events(caplog) == ["compiled", "cache", "cache"]
    np.testing.assert_allclose(np.asarray(edited), np.asarray(caffejax.compile_inference(
        net, passes=())({"data": x})["prob"]), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(edited), np.asarray(first))


def test_other_shapes_passes_and_dtypes_are_other_programs(cache):
    import jax.numpy as jnp

    net = caffejax.Net(str(LENET), str(WEIGHTS), caffejax.TEST)
    caffejax.compile_inference(net)({"data": _digits(2)})
    caffejax.compile_inference(net)({"data": _digits(5)})
    caffejax.compile_inference(net, passes=("nhwc",))({"data": _digits(2)})
    caffejax.compile_inference(net, dtype=jnp.bfloat16)({"data": _digits(2)})
    assert len(list(cache.glob("*.program"))) == 4


def test_a_damaged_program_is_compiled_again_and_replaced(cache, caplog):
    net = caffejax.Net(str(LENET), str(WEIGHTS), caffejax.TEST)
    x = _digits(2)
    expected = np.asarray(caffejax.compile_inference(net)({"data": x})["prob"])
    (path,) = cache.glob("*.program")
    path.write_bytes(path.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger=program_cache.__name__):
        got = caffejax.compile_inference(net)({"data": x})["prob"]
    assert "does not load" in caplog.text
    np.testing.assert_array_equal(np.asarray(got), expected)
    assert path.stat().st_size > 1000 and not list(cache.glob("*.tmp"))


def test_off_by_environment_and_without_jax_cache(monkeypatch, tmp_path):
    import jax

    monkeypatch.setenv(program_cache.ENVIRONMENT, "0")
    assert program_cache.cache_directory() is None
    monkeypatch.delenv(program_cache.ENVIRONMENT)
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert program_cache.cache_directory() is None
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        assert program_cache.cache_directory() == tmp_path / program_cache.SUBDIRECTORY
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_the_key_follows_the_source_and_the_description():
    import jax

    args = (np.zeros((2, 3), np.float32),)
    key = program_cache.program_key(["a"], args, {})
    assert key == program_cache.program_key(["a"], args, {})
    assert key != program_cache.program_key(["b"], args, {})
    assert key != program_cache.program_key(["a"], (np.zeros((2, 4), np.float32),), {})
    assert key != program_cache.program_key(["a"], args, {"xla_cpu_experimental_ynn_fusion_type": "x"})
    assert len(program_cache.source_digest()) == 64
