"""Lowering the kernels for CUDA on a machine without a GPU, and reading their Triton IR back out of the HLO."""
from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

H100_KIND = "NVIDIA H100 80GB HBM3"  # a device kind jax's Triton lowering maps to compute capability 9.0
TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call that carries one Pallas Triton kernel in the HLO
# tt.dot as printed: `tt.dot %a, %b, %c[, inputPrecision = tf32] : tensor<MxKxT> * tensor<KxNxT> -> tensor<MxNxT>`
_DOT = re.compile(r"tt\.dot [^:]*?(?:inputPrecision = (\w+))? : tensor<([^>]*)> \* tensor<([^>]*)> -> tensor<([^>]*)>")


def abstract_cuda_mesh(axis_sizes: tuple[int, ...] = (), axis_names: tuple[str, ...] = (),
                       device_kind: str = H100_KIND) -> AbstractMesh:
    """A mesh of abstract CUDA devices (none by default): shard_map lowers over it without any real device."""
    return AbstractMesh(axis_sizes, axis_names, axis_types=(AxisType.Auto,) * len(axis_names),
                        abstract_device=AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda"))


@contextlib.contextmanager
def abstract_gpu(device_kind: str = H100_KIND, mesh: AbstractMesh | None = None) -> Iterator[None]:
    """An abstract CUDA device in scope: jax 0.11 asks it for the compute capability when lowering a Triton
    kernel without a GPU (else "No supported GPU devices found"); jax 0.10.2 accepts it and lowers the same.
    `mesh` (abstract_cuda_mesh) puts a mesh of such devices in scope instead."""
    with use_abstract_mesh(abstract_cuda_mesh(device_kind=device_kind) if mesh is None else mesh):
        yield


def lower_for_cuda(fn: Callable, *args: Any, donate_argnums: tuple[int, ...] = (),
                   mesh: AbstractMesh | None = None) -> jax.stages.Lowered:
    """`fn` jitted, traced on `args` (arrays or ShapeDtypeStructs) and lowered for CUDA; the Pallas -> Triton
    lowering of every pallas_call runs here, nothing is compiled. `mesh`: an abstract mesh in scope, for `fn`'s
    shard_maps over it."""
    with abstract_gpu(mesh=mesh):
        return jax.jit(fn, donate_argnums=donate_argnums).trace(*args).lower(lowering_platforms=("cuda",))


def lower_jitted_for_cuda(jitted: Any, *args: Any, **static: Any) -> jax.stages.Lowered:
    """A function already wrapped in jax.jit (its donation and static arguments kept) traced on the abstract
    values of `args` (arrays become ShapeDtypeStructs, so arrays placed on the CPU lower too) and `static`
    keyword arguments, and lowered for CUDA."""
    def abstract(leaf: Any) -> Any:
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) if hasattr(leaf, "shape") else leaf

    specs = jax.tree.map(abstract, args)
    with abstract_gpu():
        return jitted.trace(*specs, **static).lower(lowering_platforms=("cuda",))


@dataclasses.dataclass(frozen=True)
class Dot:
    """One tt.dot of a kernel: operand and result tensor types as printed ("16x128xbf16") and its input
    precision (ieee, the attribute's default that the printer leaves out, or tf32 / tf32x3)."""

    lhs: str
    rhs: str
    out: str
    precision: str


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One pallas_call as XLA receives it: launch settings and the Triton IR (TTIR) as text."""

    name: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]
    ttir: str

    @property
    def dots(self) -> list[Dot]:
        return [Dot(lhs, rhs, out, precision or "ieee") for precision, lhs, rhs, out in _DOT.findall(self.ttir)]


def _custom_calls(op) -> Iterator:
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                if inner.operation.name == "stablehlo.custom_call":
                    yield inner.operation
                yield from _custom_calls(inner.operation)


def triton_kernels(lowered: jax.stages.Lowered) -> list[TritonKernel]:
    """The Triton kernels of a lowered function, in program order. Their IR is MLIR bytecode in the custom
    call's backend config (field `ir`); it is parsed back in the lowered module's own MLIR context with jaxlib's
    Triton dialect registered (jaxlib.triton, present in jaxlib 0.10.2 and 0.11.2) and printed as text."""
    from jaxlib.mlir import ir
    from jaxlib.triton import dialect as triton_dialect

    module = lowered.compiler_ir("stablehlo")
    triton_dialect.register_dialect(module.context)
    kernels = []
    for call in _custom_calls(module.operation):
        if ir.StringAttr(call.attributes["call_target_name"]).value != TRITON_CALL:
            continue
        config = call.attributes["mhlo.backend_config"]
        with module.context:
            kernel_module = ir.Module.parse(config["ir"].value_bytes)
        kernels.append(TritonKernel(
            name=ir.StringAttr(config["name"]).value,
            num_warps=ir.IntegerAttr(config["num_warps"]).value,
            num_stages=ir.IntegerAttr(config["num_stages"]).value,
            grid=tuple(ir.IntegerAttr(config[f"grid_{axis}"]).value for axis in "xyz"),
            ttir=kernel_module.operation.get_asm(enable_debug_info=False),
        ))
    return kernels
