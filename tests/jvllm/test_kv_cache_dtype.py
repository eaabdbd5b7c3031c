"""The engine's `kv_cache_dtype` option: what "auto" picks for each kind of model, and what it refuses."""
from types import SimpleNamespace

import jax.numpy as jnp
import pytest

from entrypoints.cli import build_parser
from jvllm.engine.arg_utils import EngineArgs
from jvllm.worker.kv_cache_dtype import kv_cache_dtype_for

GGUF_BLOCKS = SimpleNamespace(keeps_blocks=True, has_bf16_matrices=False, dtype=jnp.float32)
FLOAT_MODEL = SimpleNamespace(keeps_blocks=False, has_bf16_matrices=False, dtype=jnp.float32)
BF16_MATRICES = SimpleNamespace(keeps_blocks=False, has_bf16_matrices=True, dtype=jnp.float32)
BF16_MODEL = SimpleNamespace(keeps_blocks=False, has_bf16_matrices=False, dtype=jnp.bfloat16)


def test_auto_is_bfloat16_for_gguf_blocks_on_cpu_and_the_model_dtype_otherwise():
    assert kv_cache_dtype_for("auto", "auto", GGUF_BLOCKS) == jnp.bfloat16
    assert kv_cache_dtype_for(None, "auto", GGUF_BLOCKS) == jnp.bfloat16
    assert kv_cache_dtype_for("auto", "float32", GGUF_BLOCKS) == jnp.float32  # dtype="float32": float32 all through
    assert kv_cache_dtype_for("auto", "auto", FLOAT_MODEL) == jnp.float32
    assert kv_cache_dtype_for("auto", "auto", BF16_MATRICES) == jnp.bfloat16  # a float checkpoint's matrices in bf16
    assert kv_cache_dtype_for("auto", "float32", BF16_MATRICES) == jnp.float32
    assert kv_cache_dtype_for("auto", "auto", BF16_MODEL) == jnp.bfloat16


def test_a_named_dtype_wins_and_others_are_refused():
    assert kv_cache_dtype_for("float32", "auto", GGUF_BLOCKS) == jnp.float32
    assert kv_cache_dtype_for("bfloat16", "float32", FLOAT_MODEL) == jnp.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' is not supported; choose auto, float32, bfloat16"):
        kv_cache_dtype_for("fp8", "auto", FLOAT_MODEL)


def test_the_cli_flag_reaches_the_engine():
    args = build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "float32"])
    assert vars(EngineArgs.from_cli_args(args))["kv_cache_dtype"] == "float32"
    assert vars(EngineArgs.from_cli_args(build_parser().parse_args(["generate", "hi"])))["kv_cache_dtype"] == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "fp8"])


def test_a_bfloat16_pool_under_a_float32_model_decodes_like_the_float32_pool(default_engine):
    """The same float32 weights with bfloat16 KV pages: the pages hold bfloat16 bits, and greedy tokens of short
    prompts follow the float32 pages' (the pages' rounding moves scores by ~1e-3)."""
    from jvllm import Engine, SamplingParams

    engine = Engine(dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory_bytes=64 << 20, max_num_seqs=4,
                    max_model_len=512, precompile=False)
    assert engine.runner.kv_cache_dtype == jnp.bfloat16 and engine.runner.kv_cache[0][0].dtype == jnp.uint16
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are"]
    params = SamplingParams(temperature=0, max_tokens=24)
    ours = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    reference = [o.outputs[0].token_ids for o in default_engine.generate(prompts, params, use_tqdm=False)]
    assert sum(a == b for a, b in zip(ours, reference)) >= 3, (ours, reference)
