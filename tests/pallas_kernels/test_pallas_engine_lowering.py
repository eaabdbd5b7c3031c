"""The engine's step pieces on the `pallas` backend lower for CUDA on a CPU-only machine (jax 0.10.2 and 0.12): the
default model's architecture (dummy weights, bfloat16 as on a GPU), each piece traced on the inputs the runner
compiles it for. Nothing runs; the kernels are lowered compiled (JVLLM_PALLAS_INTERPRET=0), not interpreted."""
from __future__ import annotations

import re

import pytest

from jvllm import Engine
from jvllm.sample.tensors import scalars_only
from jvllm.worker.step_shapes import StepShape
from pallas_kernels.cuda_lowering import TRITON_CALL, lower_jitted_for_cuda, triton_kernels
from pallas_kernels.variants import KERNEL_NAMES

# jax 0.11 warns that the Triton lowering of pallas_call is deprecated; that must not fail CI
pytestmark = pytest.mark.filterwarnings("ignore:.*[Tt]riton.*")

POOL_PAGES = 12


@pytest.fixture(scope="module", params=[16, 32], ids=lambda size: f"page{size}")
def engine(request) -> Engine:
    """SmolLM2-135M's architecture with random bfloat16 weights; no step compiled (nor run). Its steps are built as
    on a GPU, without the CPU's native bf16 products (models.bf16_rows)."""
    block_size = request.param
    model_bytes_per_page = 2 * 30 * 3 * 64 * 2 * block_size  # K and V, 30 layers, 3 KV heads of 64, bf16
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("jvllm.worker.weights.bf16_rows_available", lambda: False)
        return Engine(load_format="dummy", dtype="bfloat16", attention_backend="pallas", block_size=block_size,
                      kv_cache_memory_bytes=POOL_PAGES * model_bytes_per_page, max_model_len=128, max_num_seqs=4,
                      precompile=False)


def step_shape(engine: Engine, kind: str) -> StepShape:
    """The engine's largest step shape of `kind` (decode: T = S = 4; prefill: T = 2048, S = 4)."""
    return max(shape for shape in engine.step_shapes() if shape.kind == kind)


def donated_arguments(text: str) -> dict[str, list[int]]:
    """Main function argument types -> the output index each argument of that type aliases (-1: donated, its
    output not chosen yet); arguments that are not donated are left out."""
    main = re.search(r"func\.func public @main\((.*?)\)\s*->", text, re.S).group(1)
    donated: dict[str, list[int]] = {}
    for arg_type, attrs in re.findall(r"%arg\d+: (tensor<[^>]*>)( \{[^}]*\})?", main):
        aliased = re.search(r"tf\.aliasing_output = (\d+)", attrs)
        if aliased or "jax.buffer_donor" in attrs:
            donated.setdefault(arg_type, []).append(int(aliased.group(1)) if aliased else -1)
    return donated


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_engine_step_pieces_lower_for_cuda(engine, kind, monkeypatch):
    """The layer (one executable for all 30 layers): exactly one Triton kernel, the shape's attention kernel, and
    four products; the KV write two XLA scatters (K and V) into the donated pools, each aliased to its own output. The
    embedding, last rows and the sampling head lower too, with no Triton kernel."""
    monkeypatch.setenv("JVLLM_PALLAS_INTERPRET", "0")  # read when the kernels are traced
    runner = engine.runner
    shape = step_shape(engine, kind)
    md, ids, positions, sampling, _, _ = runner.compiled._examples(shape)  # as CompiledSteps._compile gets them
    assert md.decode == (kind == "decode")
    steps, weights = runner.compiled.steps, runner.step_weights.for_rows(shape.tokens)

    embed = lower_jitted_for_cuda(steps.embed, weights.outer, ids, positions)
    x, cos, sin = embed.out_info  # [T, D] activations, [T, hd] rotary tables
    layer = lower_jitted_for_cuda(steps.layer, weights.layers[0], x, cos, sin, runner.kv_cache[0], md)
    last_rows = lower_jitted_for_cuda(steps.last_rows, x, sampling.token_index)
    head_logits = lower_jitted_for_cuda(steps.head_logits, weights.outer, last_rows.out_info, sampling.num_rows)
    pick = lower_jitted_for_cuda(steps.pick, head_logits.out_info, head_logits.out_info, scalars_only(sampling))

    text = layer.as_text()
    attention = KERNEL_NAMES["decode" if kind == "decode" else "ragged"]
    assert text.count(f"@{TRITON_CALL}(") == 1
    assert [kernel.name for kernel in triton_kernels(layer)] == [attention]
    assert text.count('"stablehlo.scatter"(') == 2  # write_kv's default method: an XLA scatter per pool
    # four products: q/k/v joined at load (models.llama.fuse_projections), o, gate/up joined, down
    assert text.count("stablehlo.dot_general") == 4
    config = engine.model.config
    pool_type = f"tensor<{engine.config.num_pages}x{engine.config.page_size}x{config.num_kv_heads}x" \
                f"{config.head_dim}xbf16>"
    # outputs: (x, (k_pages, v_pages)); only the two pools are donated, each updated in place into its own
    assert donated_arguments(text) == {pool_type: [1, 2]}
    for piece in (embed, last_rows, head_logits, pick):
        assert TRITON_CALL not in piece.as_text()
