"""Step pieces traced and lowered once, kept on disk as exported modules (`jax.export`): a later start of the same
engine on the same machine lowers each piece as a call of its stored module instead of tracing the model again.

A start spends most of its precompile tracing and lowering the pieces (XLA's compile already comes from JAX's
persistent cache): the default CPU engine's 105 pieces took ~7.9 s to trace and lower and ~2.9 s to load and lower
as calls (docs/design/host_loop.md, start-up). A stored module is only as good as its key: the engine's folder is
named by everything a trace reads besides the arguments (the project's source, library versions, JAX's settings,
the environment's JVLLM_ / XLA_ / JAX_ variables, the CPU, the engine's own description), and each piece's file by its
name and its arguments' shapes, dtypes and structure. Anything that fails on this path (a piece that does not
export, an unreadable file) leaves that piece to the plain path: trace and lower as without the cache."""
from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import pathlib
import platform
import re
import shutil
import sys
from typing import Any, Callable

import jax
from jax import export

from cpu_kernels.build import TARGETS, _cpu_flags
from jvllm.sample.logprobs import LogprobStats
from jvllm.worker import executable_memo
from jvllm.worker.compile_cache import exported_pieces_root

logger = logging.getLogger("jvllm")

FORMAT = 1  # bump when what a file holds or how it is named changes
KEPT_ENGINES = 16  # engine folders kept (a few MB each); the least recently used go first
SWITCH = "JVLLM_EXPORTED_PIECES"  # "0" turns the cache off
_SOURCE_PACKAGES = ("jvllm", "models", "pallas_kernels", "cpu_kernels")
_SOURCE_SUFFIXES = (".py", ".cc", ".h")
_ENV_PREFIXES = ("JVLLM_", "XLA_", "JAX_")
_VERSIONED = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes")

export.register_pytree_node_serialization(LogprobStats, serialized_name="jvllm.LogprobStats",
                                          serialize_auxdata=lambda _: b"", deserialize_auxdata=lambda _: ())


class ExportedPieces:
    """One engine's folder of exported pieces. `loaded` / `stored`: pieces read from it / written to it; `reused`:
    executables an earlier engine of this process compiled from the same stored modules; `plain`: pieces lowered
    without it."""

    def __init__(self, folder: pathlib.Path, custom_calls: tuple[str, ...] = ()) -> None:
        self.folder = folder
        self.custom_calls = custom_calls  # custom-call targets the pieces may hold (this process registers them)
        self.loaded = 0
        self.stored = 0
        self.reused = 0
        self.plain = 0

    def compile(self, name: str, fn: Any, args: tuple, static: dict[str, Any]) -> Any | None:
        """`fn.lower(*args, **static).compile()`'s equal: the executable an earlier engine of this process compiled
        from the same stored module on the same devices (the folder and file name hold everything the trace read),
        else the lowered call of the module compiled; None where this piece cannot take the path."""
        prepared = self._prepare(name, fn, args, static)
        if prepared is None:
            return None
        path, donated, devices = prepared
        key = ("exported piece", str(path), devices)
        found = executable_memo.remembered(key)
        if found is not None:
            self.reused += 1
            return found
        lowered = self._lowered(name, path, donated, fn, args, static)
        if lowered is None:
            return None
        compiled = executable_memo.compile_once(*lowered)
        executable_memo.remember(key, compiled)
        return compiled

    def lower(self, name: str, fn: Any, args: tuple, static: dict[str, Any]) -> jax.stages.Lowered | None:
        """`fn.lower(*args, **static)`'s equal, lowered as a call of the stored module (exported and stored first if
        missing); None where this piece cannot take the path (the caller lowers it plainly)."""
        prepared = self._prepare(name, fn, args, static)
        lowered = None if prepared is None else self._lowered(name, *prepared[:2], fn, args, static)
        return None if lowered is None else lowered[0]

    def _prepare(self, name: str, fn: Any, args: tuple, static: dict[str, Any]
                 ) -> tuple[pathlib.Path, tuple[int, ...], tuple] | None:
        """(the piece's file, the argument positions fn donates, the arguments' devices), or None (counted plain)
        where it cannot be kept."""
        donated = _donated_positions(fn)
        try:
            if donated is not None:
                leaves, tree = jax.tree.flatten(args)
                path = self.folder / f"{_piece_digest(name, leaves, tree, static)}.jaxexp"
                return path, donated, _devices(leaves)
        except Exception as error:  # noqa: BLE001 - any failure here only costs this piece the plain path's time
            logger.debug("piece %s without its exported module: %s", name, error)
        self.plain += 1
        return None

    def _lowered(self, name: str, path: pathlib.Path, donated: tuple[int, ...], fn: Any, args: tuple,
                 static: dict[str, Any]) -> tuple[jax.stages.Lowered, str] | None:
        """(the call of the stored module lowered for args, a digest of the stored module's bytes)."""
        try:
            read = self._read(path)
            if read is None:
                leaves, tree = jax.tree.flatten(args)
                exported = self._export(fn, leaves, tree, static)
                data = self._write(path, exported)
            else:
                exported, data = read
            return jax.jit(_calling(exported), donate_argnums=donated).lower(*args), hashlib.sha256(data).hexdigest()
        except Exception as error:  # noqa: BLE001 - any failure here only costs this piece the plain path's time
            logger.debug("piece %s lowered without its exported module: %s", name, error)
            self.plain += 1
            return None

    def _read(self, path: pathlib.Path) -> tuple[export.Exported, bytes] | None:
        try:
            data = path.read_bytes()
        except OSError:
            return None
        try:
            exported = export.deserialize(bytearray(data))
        except Exception:  # noqa: BLE001 - a damaged or foreign file: export the piece again
            path.unlink(missing_ok=True)
            return None
        self.loaded += 1
        return exported, data

    def _export(self, fn: Any, leaves: list, tree: Any, static: dict[str, Any]) -> export.Exported:
        def flat(*flat_args: Any) -> Any:
            return fn(*jax.tree.unflatten(tree, flat_args), **static)

        checks = [export.DisabledSafetyCheck.custom_call(target) for target in self.custom_calls]
        return export.export(jax.jit(flat), disabled_checks=checks)(*leaves)

    def _write(self, path: pathlib.Path, exported: export.Exported) -> bytes:
        """Atomically: a start beside this one reads a whole file or none. Returns what was written."""
        data = exported.serialize()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_bytes(data)
        os.replace(partial, path)
        self.stored += 1
        return bytes(data)


def engine_pieces(description: tuple) -> ExportedPieces | None:
    """The exported pieces of an engine on a CPU without a mesh (the only place this path is checked so far), whose
    trace reads `description` (model config, structure, attention backend, settings, layer runs) besides its
    arguments; None while this process keeps off the persistent caches."""
    root = exported_pieces_root()
    if root is None:
        return None
    text = re.sub(r" at 0x[0-9a-f]+", "", repr(description))  # functions by name: the source digest holds their code
    return exported_pieces(root, text, tuple(TARGETS))


def exported_pieces(root: pathlib.Path, engine: str, custom_calls: tuple[str, ...] = ()) -> ExportedPieces | None:
    """The pieces folder of an engine described by `engine` (a text holding everything its trace reads that the
    arguments do not show) under `root`; None where turned off (JVLLM_EXPORTED_PIECES=0)."""
    if os.environ.get(SWITCH, "").strip().lower() in ("0", "false", "no", "off"):
        return None
    digest = hashlib.sha256(f"{FORMAT}\n{_process_digest()}\n{engine}".encode()).hexdigest()[:32]
    folder = root / digest
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.utime(folder)  # most recently used
        _forget_old_engines(root, keep=folder)
    except OSError as error:
        logger.debug("no exported pieces: %s", error)
        return None
    return ExportedPieces(folder, custom_calls)


def _calling(exported: export.Exported) -> Callable[..., Any]:
    """The step's arguments, structured as the runner passes them, -> the stored module's results."""
    def call(*args: Any) -> Any:
        return exported.call(*jax.tree.leaves(args))

    return call


def _devices(leaves: list) -> tuple[tuple[int, ...], ...]:
    """The device ids of each argument that has a placement (the abstract ones given without one have none)."""
    placed = (getattr(leaf, "sharding", None) for leaf in leaves)
    return tuple(tuple(sorted(d.id for d in s.device_set)) for s in placed if s is not None)


def _donated_positions(fn: Any) -> tuple[int, ...] | None:
    """The positions of the arguments `fn` (a jax.jit function) donates; None where its settings cannot be read or
    are ones a plain call of the stored module would not keep (shardings, layouts, compiler options)."""
    info = getattr(fn, "_jit_info", None)
    try:
        plain = (not info.user_specified_in_shardings and not info.keep_unused and not info.compiler_options_kvs
                 and all(type(s).__name__ == "UnspecifiedValue" for s in info.out_shardings_leaves)
                 and all(layout is None for layout in (*info.in_layouts_leaves, *info.out_layouts_leaves)))
        return tuple(info.donate_argnums) if plain else None
    except AttributeError:
        return None


def _piece_digest(name: str, leaves: list, tree: Any, static: dict[str, Any]) -> str:
    parts = [name, str(tree), repr(sorted(static.items()))]
    for leaf in leaves:
        aval = jax.typeof(leaf) if hasattr(jax, "typeof") else jax.core.get_aval(leaf)
        parts.append(f"{aval.str_short()} weak={getattr(aval, 'weak_type', False)} {type(leaf).__name__}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


_installed_text: str | None = None


def _process_digest() -> str:
    """What every engine of this process shares: the project's source, versions and CPU (read once), and JAX's
    settings, the environment's variables and the devices (read at each engine's start: a program may change them)."""
    global _installed_text
    if _installed_text is None:
        root = pathlib.Path(__file__).resolve().parents[2]
        source = hashlib.sha256()
        for package in _SOURCE_PACKAGES:
            for path in sorted((root / package).rglob("*")):
                if path.suffix in _SOURCE_SUFFIXES and "__pycache__" not in path.parts:
                    source.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
        versions = []
        for package in _VERSIONED:
            try:
                versions.append(f"{package}={importlib.metadata.version(package)}")
            except importlib.metadata.PackageNotFoundError:
                versions.append(f"{package}=none")
        _installed_text = "\n".join([source.hexdigest(), sys.version, platform.machine(), " ".join(versions),
                                      _cpu_flags()])
    environment = sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES))
    devices = [(d.platform, d.device_kind) for d in jax.devices()]
    text = "\n".join([_installed_text, repr(environment), repr(sorted(jax.config.values.items())), repr(devices)])
    return hashlib.sha256(text.encode()).hexdigest()


def _forget_old_engines(root: pathlib.Path, keep: pathlib.Path) -> None:
    folders = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in folders[KEPT_ENGINES:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)
