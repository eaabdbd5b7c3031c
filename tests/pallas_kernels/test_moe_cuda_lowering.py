"""MoE layers lowered for CUDA on a CPU-only machine (jax 0.10.2 and 0.12) launch the Pallas grouped-matmul kernel:
three calls (gate, up, down) per MoE layer; under a 2-device abstract mesh inside a shard_map, each on its device's
half of the intermediate width, with one all-reduce. JVLLM_MOE_EXPERTS=pallas stands for the GPU's default choice
(the trace runs on the CPU backend) and JVLLM_PALLAS_INTERPRET=0 lowers the kernels compiled."""
from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jvllm import Engine
from models import moe
from models.config import MoEConfig
from pallas_kernels.cuda_lowering import TRITON_CALL, abstract_cuda_mesh, lower_for_cuda, lower_jitted_for_cuda, \
    triton_kernels
from pallas_kernels.variants import KERNEL_NAMES

# jax 0.11 warns that the Triton lowering of pallas_call is deprecated; that must not fail CI
pytestmark = pytest.mark.filterwarnings("ignore:.*[Tt]riton.*")

GROUPED = "jvllm_grouped_matmul"
# Qwen3-30B-A3B's experts: 128 of 2048 -> 768, top 8; 64 tokens make 512 token choices
TOKENS, HIDDEN, WIDTH, EXPERTS, TOP_K = 64, 2048, 768, 128, 8


@pytest.fixture(autouse=True)
def compiled_pallas_experts(monkeypatch):
    monkeypatch.setenv(moe.EXPERTS_ENV, "pallas")
    monkeypatch.setenv("JVLLM_PALLAS_INTERPRET", "0")  # read when the kernels are traced


def lower_moe_layer(mesh=None) -> jax.stages.Lowered:
    """A SparseMoE of abstract bfloat16 weights applied to [TOKENS, HIDDEN] activations, lowered for CUDA."""
    config = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, intermediate_size=WIDTH, normalize_top_k=True,
                       sparse_layers=(True,))
    graphdef, state = nnx.split(moe.SparseMoE(HIDDEN, config, jnp.bfloat16, rngs=None))  # weights as shapes only

    def layer(state, x):
        return nnx.merge(graphdef, state)(x, mesh)

    return lower_for_cuda(layer, state, jax.ShapeDtypeStruct((TOKENS, HIDDEN), jnp.bfloat16), mesh=mesh)


@pytest.mark.parametrize("tp", [1, 2])
def test_moe_layer_launches_three_grouped_matmuls(tp):
    """gate and up [E, D, F / tp] then down [E, F / tp, D]: one program per (work item, 64 columns), the items
    (token choices / 16 row tiles + experts - 1) the same on every device; at TP=2 inside the shard_map, whose
    partial sums one all-reduce adds up."""
    mesh = abstract_cuda_mesh((1, 2), ("dp", "tp")) if tp > 1 else None
    lowered = lower_moe_layer(mesh)
    text = lowered.as_text()
    kernels = triton_kernels(lowered)
    assert text.count(f"@{TRITON_CALL}(") == 3
    assert [kernel.name for kernel in kernels] == [GROUPED] * 3
    items = TOKENS * TOP_K // 16 + EXPERTS - 1
    columns = WIDTH // tp // 64
    assert [kernel.grid[:2] for kernel in kernels] == [(items, columns), (items, columns), (items, HIDDEN // 64)]
    assert all(dot.out == "16x64xf32" for kernel in kernels for dot in kernel.dots)
    assert "ragged_dot" not in text
    if tp == 1:
        assert "all_reduce" not in text and "manual_computation" not in text
    else:
        assert text.count("sdy.manual_computation") == 1 and text.count("stablehlo.all_reduce") == 1


# A tiny Qwen3-MoE: layer 0 a mixture of 8 experts (top 2, width 128), layer 1 dense (`mlp_only_layers`)
TINY_QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=49152, hidden_size=256,
                      intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e6,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=128, norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1)


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory) -> Engine:
    """The tiny Qwen3-MoE with random bfloat16 weights on the pallas backend; no step compiled (nor run)."""
    from jvllm.model_loader.default_model import default_model_path
    from jvllm.model_loader.loader import _gguf_as_hf_folder

    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    (pathlib.Path(folder) / "config.json").write_text(json.dumps(TINY_QWEN3_MOE))
    return Engine(str(folder), tokenizer=str(_gguf_as_hf_folder(default_model_path())), load_format="dummy",
                  dtype="bfloat16", attention_backend="pallas", kv_cache_memory_bytes=1 << 20, max_model_len=128,
                  max_num_seqs=4, precompile=False)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_engine_moe_layer_lowers_with_its_kernels(moe_engine, kind):
    """The engine's layer executables for the shape: the MoE group runs the attention kernel and three grouped
    matmuls, the dense group the attention kernel alone."""
    runner = moe_engine.runner
    shape = max(s for s in moe_engine.step_shapes() if s.kind == kind)
    md, ids, positions, _, _, _ = runner.compiled._examples(shape)
    steps, weights, parts = runner.compiled.steps, runner.step_weights.for_rows(shape.tokens), runner.step_weights.parts
    x, cos, sin = lower_jitted_for_cuda(steps.embed, weights.outer, ids, positions).out_info
    attention = KERNEL_NAMES["decode" if kind == "decode" else "ragged"]
    assert parts.layer_groups == (0, 1)
    for group, expected in ((0, [attention] + [GROUPED] * 3), (1, [attention])):
        first = parts.group_first_layers[group]
        layer = lower_jitted_for_cuda(steps.layer, weights.layers[first], x, cos, sin, runner.kv_cache[first], md,
                                      group=group)
        assert layer.as_text().count(f"@{TRITON_CALL}(") == len(expected)
        kernels = triton_kernels(layer)
        assert [kernel.name for kernel in kernels] == expected
        if group == 0:  # the token choices of the shape: T x top-2 rows in 16-row tiles, plus experts - 1 items
            assert {kernel.grid[0] for kernel in kernels[1:]} == {-(-shape.tokens * 2 // 16) + 8 - 1}
