"""docs/pallas.md's table of sm_90 registers, spills, shared memory and CTAs per SM for every compiled kernel variant.

Run `python -m pallas_kernels.resource_table` (needs `triton`; ~2-4 minutes) to print the table's rows."""
from __future__ import annotations

from pallas_kernels.cuda_lowering import lower_for_cuda, triton_kernels
from pallas_kernels.ptx_resources import Resources, compile_for_sm90
from pallas_kernels.variants import Variant, compile_variants

TABLE_JAX_VERSION = (0, 11, 2)  # the Triton IR the table was measured from (jaxlib's lowering)
HEADER = ("| variant | warps | stages | registers | stack + spill bytes | shared bytes | CTAs/SM |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")


def measure(variant: Variant) -> Resources:
    """Lower the variant for CUDA and compile its (first) Triton kernel for sm_90 at its launch settings."""
    fn, args = variant.call()
    return compile_for_sm90(triton_kernels(lower_for_cuda(fn, *args))[0])


def row(variant: Variant, res: Resources) -> str:
    spilled = res.stack_bytes + res.spill_store_bytes + res.spill_load_bytes
    return (f"| {variant.id} | {res.num_warps} | {res.num_stages} | {res.registers} | {spilled} | "
            f"{res.shared_bytes} | {res.ctas_per_sm} |")


def rows_in(markdown: str) -> dict[str, str]:
    """Table rows of a markdown text keyed by their first cell (the variant id), stripped."""
    out = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 7:
            out[cells[0]] = line.strip()
    return out


def summary(measured: list[tuple[Variant, Resources]]) -> str:
    """One line per kernel, dtype and head dim: launch, register range, most spill and shared bytes, fewest
    CTAs per SM over its page sizes, groups and window."""
    groups: dict[tuple[str, str, int], list[Resources]] = {}
    for variant, res in measured:
        groups.setdefault((variant.kernel, variant.dtype, variant.head_dim), []).append(res)
    lines = ["| kernel | dtype | head dim | warps | stages | registers | stack + spill bytes | shared bytes | "
             "CTAs/SM |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (kernel, dtype, head_dim), results in groups.items():
        regs = sorted(r.registers for r in results)
        spilled = max(r.stack_bytes + r.spill_store_bytes + r.spill_load_bytes for r in results)
        lines.append(f"| {kernel} | {dtype} | {head_dim} | {results[0].num_warps} | {results[0].num_stages} | "
                     f"{regs[0]}-{regs[-1]} | {spilled} | {max(r.shared_bytes for r in results)} | "
                     f"{min(r.ctas_per_sm for r in results)} |")
    return "\n".join(lines)


def main() -> None:
    measured = []
    print(HEADER)
    for variant in compile_variants():
        measured.append((variant, measure(variant)))
        print(row(*measured[-1]), flush=True)
    print()
    print(summary(measured))


if __name__ == "__main__":
    main()
