"""The engine's `kv_cache_dtype` option: what "auto" picks for each kind of model, and what it refuses."""
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
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
    assert kv_cache_dtype_for("fp8_e5m2", "auto", GGUF_BLOCKS) == jnp.float8_e5m2
    assert kv_cache_dtype_for("fp8_e5m2", "auto", FLOAT_MODEL, "xla") == jnp.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not supported; choose auto, float32, bfloat16, "
                                         "fp8_e5m2"):
        kv_cache_dtype_for("int8", "auto", FLOAT_MODEL)
    for e4m3 in ("fp8", "fp8_e4m3"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype '{e4m3}' .* is not supported; fp8_e5m2 is"):
            kv_cache_dtype_for(e4m3, "auto", FLOAT_MODEL)
    with pytest.raises(ValueError, match="read by the cpu and xla attention backends, not by 'pallas'"):
        kv_cache_dtype_for("fp8_e5m2", "auto", FLOAT_MODEL, "pallas")


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


TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
        "metal type, oil-based inks and a wooden press adapted from wine making. Within decades, printing shops had "
        "spread across Europe, and the cost of books fell sharply. Literacy rose, scholars could compare identical "
        "copies of texts, and new ideas travelled faster than ever before.")


def _text_logprobs(engine) -> np.ndarray:
    """The log-probability of each token of TEXT after the ones before it."""
    from jvllm import SamplingParams

    (out,) = engine.generate([TEXT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return np.array([d[i].logprob for d, i in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])])


def test_eight_bit_pages_hold_twice_the_tokens_and_keep_the_text_s_probabilities():
    """fp8_e5m2 pages: twice the pages of bfloat16 ones in the same bytes; the `cpu` and `xla` backends read them,
    a text's token log-probabilities stay near the bfloat16 pages' (every key and value rounded to 2 mantissa bits:
    measured mean shift 0.15 (cpu) and 0.19 (xla), the largest 0.76; a wrong kernel moves them by whole units), and
    generation goes on."""
    from jvllm import Engine, SamplingParams

    common = dict(kv_cache_memory_bytes=16 << 20, max_num_seqs=4, max_model_len=512, precompile=False)
    bf16 = Engine(**common)
    reference, bf16_pages = _text_logprobs(bf16), bf16.config.num_pages
    del bf16
    for backend in ("cpu", "xla"):
        engine = Engine(kv_cache_dtype="fp8_e5m2", attention_backend=backend, **common)
        assert engine.runner.kv_cache[0][0].dtype == jnp.float8_e5m2
        assert abs(engine.config.num_pages - 2 * bf16_pages) <= 1  # (page 0 is reserved)
        shift = np.abs(_text_logprobs(engine) - reference)
        assert shift.mean() < 0.3 and shift.max() < 1.5, (backend, shift.mean(), shift.max())
        (out,) = engine.generate(["Name three rivers of Europe."], SamplingParams(temperature=0, max_tokens=24),
                                 use_tqdm=False)
        assert len(out.outputs[0].token_ids) > 3 and out.outputs[0].text.strip()
        del engine
