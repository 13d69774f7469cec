"""Compiled programs kept on disk, so that a new process runs a net without tracing it again.

JAX's persistent compilation cache (``jax_compilation_cache_dir``) saves XLA's compile, but finds its entry
by the lowered program: every new process still traces the net's Python and lowers it to StableHLO first,
which for GoogLeNet costs about a second, more than loading the compiled program. Where that cache is on,
caffejax keeps beside it, under ``caffejax-programs/``, the serialized executables of its inference programs
(``compile_inference``), ``Net.forward``'s and solvers' iterations, keyed by what decides them, and a later
process loads the executable directly:

- the program: every layer of the optimised plan (its LayerParameter, wiring, kernel), every value's shape,
  and the arguments' shapes and dtypes;
- the code that traces it: a digest of caffejax's own source files;
- the compiler: jax and jaxlib versions, backend and device kind, ``XLA_FLAGS``, the program's compiler
  options and the jax settings that change lowering (x64, default matmul precision).

Graphs with Python layers (but data layers, whose tops are fed) or rules the user registered are never cached
(their code lives outside caffejax). A file that fails to load (another jaxlib, a truncated write) is compiled
again and replaced.
``CAFFEJAX_PROGRAM_CACHE=0`` turns the cache off; ``CAFFEJAX_PROGRAM_CACHE=DIR`` puts it in DIR even without
JAX's cache.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pathlib
import pickle
from typing import Any, Callable, Mapping

import jax
import numpy as np

from caffejax.fileio import atomic_write
from caffejax.lower.python_layer import calls_back
from caffejax.lower.registry import get_rule
from caffejax.runtime.memory import garbage_collection_paused
from caffejax.runtime.mode import environment_switch

ENVIRONMENT = "CAFFEJAX_PROGRAM_CACHE"
SUBDIRECTORY = "caffejax-programs"
_FORMAT = b"caffejax-program-1"

log = logging.getLogger(__name__)


def cache_directory() -> pathlib.Path | None:
    """Where programs are kept: ``$CAFFEJAX_PROGRAM_CACHE``, else beside JAX's persistent cache, else None."""
    chosen, switch = os.environ.get(ENVIRONMENT, "").strip(), environment_switch(ENVIRONMENT)
    if switch is False:
        return None
    if chosen and switch is None:
        return pathlib.Path(chosen)
    jax_cache = jax.config.jax_compilation_cache_dir
    if not jax_cache or "://" in str(jax_cache):  # remote caches (gs://...) are JAX's business alone
        return None
    return pathlib.Path(jax_cache) / SUBDIRECTORY


@functools.cache
def source_digest() -> str:
    """sha256 of every Python source file of the caffejax package: new code, new programs."""
    package = pathlib.Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _environment(options: Mapping[str, str]) -> list[str]:
    import jaxlib

    devices = jax.devices()
    return [jax.__version__, jaxlib.__version__, jax.default_backend(), devices[0].device_kind,
            str(len(devices)), os.environ.get("XLA_FLAGS", ""), repr(sorted(options.items())),
            str(jax.config.jax_enable_x64), str(jax.config.jax_default_matmul_precision), source_digest()]


def _avals(tree) -> str:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return repr(treedef) + repr([(tuple(x.shape), str(x.dtype)) for x in leaves])


def describe_graph(graph, kernels: Mapping[str, Any]) -> list[bytes | str] | None:
    """What a program over ``graph`` computes, with ``kernels`` (layer name -> kernel) running those layers:
    the parts of its cache key (None: not cacheable). Callers put in front what else decides their program."""
    if any(calls_back(layer) or not get_rule(layer.type).forward.__module__.startswith("caffejax.")
           for layer in graph.layers):
        # Python layers the program calls and rules registered by the user: code no digest of caffejax's covers.
        # A Python data layer's tops are fed: the program only takes them.
        return None
    parts: list[bytes | str] = [repr((graph.phase, graph.outputs)), repr(sorted(graph.fed.items())),
                                repr(sorted(graph.value_shapes.items()))]
    for value, data in sorted(graph.concrete.items()):  # data that decided shapes enters as constants
        parts.append(repr((value, np.asarray(data).dtype.str, np.shape(data))))
        parts.append(np.ascontiguousarray(data).tobytes())
    for layer in graph.layers:
        kernel = kernels.get(layer.name)
        parts.append(repr((layer.name, layer.bottom_values, layer.top_values, layer.is_input,
                           kernel.name if kernel is not None else None)))
        parts.append(layer.proto.SerializeToString(deterministic=True))
    return parts


def program_key(description: list[bytes | str], args: tuple, options: Mapping[str, str]) -> str:
    """The cache key of one program: its ``description`` (what the traced function computes), the
    arguments' shapes and dtypes, and the environment that compiles it."""
    digest = hashlib.sha256(_FORMAT)
    for part in [*description, _avals(args), *_environment(options)]:
        data = part if isinstance(part, bytes) else part.encode()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def compile_program(function: Callable, args: tuple, *, options: Mapping[str, str],
                    description: list[bytes | str] | None, donate_argnums: tuple[int, ...] = (),
                    keep_unused: bool = False) -> Callable:
    """``function`` compiled for ``args`` (arrays or ``jax.ShapeDtypeStruct``) with ``options``, giving up
    the arguments ``donate_argnums`` and keeping unused ones if ``keep_unused`` (as ``jax.jit``'s): loaded from
    the program cache when it holds it, otherwise compiled and stored there. ``description=None`` compiles
    without the cache."""
    jitted = jax.jit(function, compiler_options=dict(options), donate_argnums=donate_argnums,
                     keep_unused=keep_unused)
    if description is not None and donate_argnums:
        description = [*description, f"donates {tuple(donate_argnums)}"]
    if description is not None and keep_unused:
        description = [*description, "keeps unused arguments"]
    directory = cache_directory() if description is not None else None
    placed = {d for leaf in jax.tree.leaves(args) if isinstance(leaf, jax.Array) for d in leaf.sharding.device_set}
    if placed - {jax.devices()[0]}:  # a loaded executable runs on the first device: others compile afresh
        directory = None
    if directory is None:
        return jitted.lower(*args).compile()
    from jax.experimental import serialize_executable

    path = directory / f"{program_key(description, args, options)}.program"
    if path.exists():
        try:
            with garbage_collection_paused():  # read back, the executable is many objects that all live on
                payload, in_tree, out_tree = pickle.loads(path.read_bytes())
                # One device: by default the loader would spread the executable over every device of the backend.
                loaded = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                                   execution_devices=[jax.devices()[0]])
            log.debug("caffejax: program %s loaded from the cache", path.name)
            return loaded
        except Exception as error:  # another jaxlib or a damaged file: compile again, replace it
            log.warning("caffejax: cached program %s does not load (%s: %s); compiling it again", path.name,
                        type(error).__name__, error)
    lowered = jitted.lower(*args)
    fresh = _without_jax_cache()
    if fresh is None:  # cannot keep JAX's cache out of this compile: compile, but keep nothing
        return lowered.compile()
    with fresh:
        compiled = lowered.compile()
    log.debug("caffejax: program %s compiled", path.name)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write(path, pickle.dumps(serialize_executable.serialize(compiled)))
    except Exception as error:  # a full disk or a read-only cache costs the next start, never this one
        log.warning("caffejax: could not keep the compiled program in %s (%s: %s)", directory,
                    type(error).__name__, error)
    return compiled


def _without_jax_cache():
    """A context in which XLA compiles afresh rather than loading from JAX's persistent cache, or None where
    this jax has no such switch. An executable JAX loaded from its cache serializes without some of its
    kernels: stored and loaded again, it fails when called ("NOT_FOUND: Function copy_bitcast_fusion not
    found"; jax 0.10.2 on the CPU, LeNet and GoogLeNet alike). A program is compiled for this cache once."""
    try:
        from jax._src import config
        from jax.experimental.compilation_cache import compilation_cache
    except ImportError:
        return None
    switch = getattr(config, "enable_compilation_cache", None)
    reset = getattr(compilation_cache, "reset_cache", None)
    return _cache_switched_off(switch, reset) if callable(switch) and callable(reset) else None


@contextlib.contextmanager
def _cache_switched_off(switch, reset):
    """JAX decides at a process's first compile whether its cache is used and keeps the answer, so the setting
    alone does not reach later compiles: jax 0.12.1 then loaded the program from its cache (and the kept one
    failed in the next process: "NOT_FOUND: Function transpose_copy_fusion.1 not found"), and jax 0.10.2 looked
    it up under another key, missed, and wrote it there. The decision is reset on the way in, so that the
    compile inside finds the cache off, and on the way out, so that later compiles find it on again."""
    with switch(False):
        reset()
        try:
            yield
        finally:
            reset()


def jit_through_cache(function: Callable, *, options: Mapping[str, str],
                      describe: Callable[[], list[bytes | str] | None], donate_argnums: tuple[int, ...] = (),
                      keep_unused: bool = False) -> Callable:
    """``jax.jit(function)`` with ``options``, ``donate_argnums`` and ``keep_unused``, for callers that know what a
    program computes before they know its arguments. Where the cache is on and ``describe()`` gives a description
    (it runs only then), the program goes through :func:`compile_program` for the arguments of its first call
    instead; later calls must pass arguments of the same structure, shapes and dtypes."""
    description = describe() if cache_directory() is not None else None
    if description is None:
        return jax.jit(function, compiler_options=dict(options), donate_argnums=donate_argnums,
                       keep_unused=keep_unused)
    compiled = None

    def run(*args):
        nonlocal compiled
        if compiled is None:
            compiled = compile_program(function, args, options=options, description=description,
                                       donate_argnums=donate_argnums, keep_unused=keep_unused)
        return compiled(*args)

    return run
