"""Weight-only int8 / fp8 projections lower for CUDA on a CPU-only machine (jax 0.10.2 and 0.12): a quantized
Linear of Llama-3-8B's gate/up shape takes its weights as 1-byte codes (half of bf16's bytes), converts them as the
dot's operand (no dequantized weight argument, no weight-sized multiply), and applies the scales to the product.
Whether XLA GPU then fuses the convert into the GEMM is a compile-time choice, reported by the device stage
(benchmarks/gpu_quant_matmul.py). jax's Hopper int8 x bf16 Mosaic GPU kernel lowers for the same weights."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from models.channel_quant import CHANNEL_FORMATS
from models.layers import Linear
from pallas_kernels.cuda_lowering import lower_for_cuda

# jax 0.11 warns that the Triton lowering of pallas_call (the engine's attention) is deprecated; that must not fail CI
pytestmark = pytest.mark.filterwarnings("ignore:.*[Tt]riton.*")

D_IN, D_OUT = 4096, 14336  # Llama-3-8B gate_proj / up_proj
MLIR_TYPES = {"int8_channel": "i8", "fp8_channel": "f8E4M3FN"}


def quantized_linear(fmt: str) -> tuple[nnx.GraphDef, nnx.State]:
    """A quantized Linear whose state holds only shapes (nothing allocated)."""
    layer = Linear(D_IN, D_OUT, bias=False, dtype=jnp.bfloat16, rngs=None)
    layer.set_quantized(jax.ShapeDtypeStruct((D_OUT, D_IN), CHANNEL_FORMATS[fmt].dtype), fmt,
                        jax.ShapeDtypeStruct((D_OUT,), jnp.float32))
    return nnx.split(layer)


def main_arguments(text: str) -> list[str]:
    main = re.search(r"func\.func public @main\((.*?)\)\s*->", text, re.S).group(1)
    return re.findall(r"%arg\d+: (tensor<[^>]*>)", main)


@pytest.mark.parametrize("rows", [1, 256])
@pytest.mark.parametrize("fmt", sorted(CHANNEL_FORMATS))
def test_quantized_projection_lowers_with_one_byte_weights(fmt, rows):
    graphdef, state = quantized_linear(fmt)
    x = jax.ShapeDtypeStruct((rows, D_IN), jnp.bfloat16)
    text = lower_for_cuda(lambda s, x: nnx.merge(graphdef, s)(x), state, x).as_text()
    code = MLIR_TYPES[fmt]
    codes_type = f"tensor<{D_OUT}x{D_IN}x{code}>"
    assert sorted(main_arguments(text)) == sorted([codes_type, f"tensor<{D_OUT}xf32>", f"tensor<{rows}x{D_IN}xbf16>"])
    assert jnp.dtype(CHANNEL_FORMATS[fmt].dtype).itemsize * 2 == jnp.dtype(jnp.bfloat16).itemsize
    # the codes are converted to bf16 and that value is the dot's right operand, contracted over K
    convert = re.search(rf"(%\d+) = stablehlo\.convert (%arg\d+) : \({re.escape(codes_type)}\) -> "
                        rf"tensor<{D_OUT}x{D_IN}xbf16>", text)
    assert convert is not None, text
    dot = re.search(rf"stablehlo\.dot_general %arg\d+, {convert.group(1)}, contracting_dims = \[1\] x \[1\].*"
                    rf"-> tensor<{rows}x{D_OUT}xf32>", text)
    assert dot is not None, text
    # the scales multiply the [rows, out] product; nothing of the weights' size is multiplied or materialized
    assert re.search(rf"stablehlo\.multiply .* : tensor<{rows}x{D_OUT}xf32>", text)
    assert not re.search(rf"stablehlo\.multiply .* : tensor<{D_OUT}x{D_IN}x", text)
    assert len(re.findall(rf"{convert.group(1)}\b", text)) == 2  # defined, then read by the dot alone


@pytest.mark.parametrize("rows", [64, 256])
def test_hopper_mixed_type_mosaic_kernel_lowers_for_the_codes(rows, monkeypatch):
    """jax's int8 x bf16 Mosaic GPU kernel (the codes [N, K] as its register-fed LHS, x^T as its RHS) lowers
    offline. Its grid is the device's SM count, read from the default device when traced: a CPU device has
    none, so H100's 132 stands in."""
    mixed = pytest.importorskip("jax.experimental.pallas.ops.gpu.hopper_mixed_type_matmul_mgpu")
    from types import SimpleNamespace

    from benchmarks.gpu_quant_matmul import mosaic_int8_dot

    monkeypatch.setattr(mixed, "backend", SimpleNamespace(get_default_device=lambda: SimpleNamespace(core_count=132)))
    args = (jax.ShapeDtypeStruct((rows, D_IN), jnp.bfloat16), jax.ShapeDtypeStruct((D_OUT, D_IN), jnp.int8),
            jax.ShapeDtypeStruct((D_OUT,), jnp.float32))
    text = lower_for_cuda(mosaic_int8_dot, *args).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert f"tensor<{D_OUT}x{D_IN}xi8>" in main_arguments(text)
    assert f"tensor<{D_OUT}x{D_IN}xbf16>" not in text  # the kernel converts in registers


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_the_quantized_engines_layer_and_head_take_the_codes(quantization, tmp_path, monkeypatch):
    """A tiny Llama (dummy weights, bfloat16, the pallas backend) with the GPU formats that quantization= picks on
    a GPU: its compiled layer and sampling head receive the 1-byte codes, no float matrix of any projection."""
    import json

    from jvllm import Engine
    from jvllm.model_loader import quantize_weights
    from pallas_kernels.cuda_lowering import lower_jitted_for_cuda
    from tests.hf_weights import save_byte_level_tokenizer

    monkeypatch.setattr(quantize_weights, "load_backend", lambda: "gpu")
    monkeypatch.setenv("JVLLM_PALLAS_INTERPRET", "0")
    save_byte_level_tokenizer(tmp_path, "a tiny model")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "vocab_size": 320}))
    engine = Engine(str(tmp_path), load_format="dummy", dtype="bfloat16", attention_backend="pallas",
                    quantization=quantization, kv_cache_memory_bytes=1 << 20, max_model_len=128, max_num_seqs=4,
                    precompile=False)
    runner = engine.runner
    shape = max(s for s in engine.step_shapes() if s.kind == "decode")
    md, ids, positions, sampling, _, _ = runner.compiled._examples(shape)
    steps, weights = runner.compiled.steps, runner.step_weights.for_rows(shape.tokens)
    x, cos, sin = lower_jitted_for_cuda(steps.embed, weights.outer, ids, positions).out_info
    layer = main_arguments(lower_jitted_for_cuda(steps.layer, weights.layers[0], x, cos, sin, runner.kv_cache[0],
                                                 md).as_text())
    last = lower_jitted_for_cuda(steps.last_rows, x, sampling.token_index).out_info
    head = main_arguments(lower_jitted_for_cuda(steps.head_logits, weights.outer, last,
                                                sampling.num_rows).as_text())
    code = MLIR_TYPES[f"{quantization}_channel"]
    # q/k/v joined at load (models.llama.fuse_projections), o, gate/up joined, down
    projections = ["512x256", "256x256", "1024x256", "256x512"]
    assert sorted(t for t in layer if re.fullmatch(rf"tensor<\d+x\d+x{code}>", t)) == sorted(
        f"tensor<{p}x{code}>" for p in projections)
    apart = ["128x256", "512x256"]  # k or v, gate or up: a float copy of one would show
    shapes = {*projections, *apart, *("x".join(reversed(p.split("x"))) for p in projections + apart)}
    assert not [t for t in layer if re.fullmatch(rf"tensor<({'|'.join(shapes)})x(bf16|f32)>", t)]  # no float weight
    assert f"tensor<320x256x{code}>" in head  # the LM head's codes [V, D]
