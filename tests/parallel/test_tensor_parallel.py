"""Tensor parallelism on virtual CPU devices: TP=N matches TP=1, and the sharded step's collectives.

Every multi-device run happens in a subprocess (tests/parallel/tp_worker.py) started with
XLA_FLAGS=--xla_force_host_platform_device_count=N, so this pytest process keeps its single device.

* Logits: TP=N vs TP=1 at every prompt position, float32, max |diff| < LOGITS_ATOL (measured ~1.5e-5 with
  logits of magnitude ~9: only the summation order of the all-reduced partial sums differs).
* Greedy tokens: identical (tiny random models and SmolLM2-135M at TP=3).
* The compiled decode step: one all-reduce of [T, D] after each row-parallel matmul (o_proj, down_proj) plus
  one for the vocab-parallel embedding lookup; the only all-gather is the [S, V] logits the sampler needs;
  nothing weight-shaped is ever gathered. The pool write has no collective at all.
"""
from __future__ import annotations

import re

import pytest

from jvllm.parallel.mesh import check_tensor_parallel_size, working_sizes
from tests.parallel.processes import run_worker

LOGITS_ATOL = 1e-4
# 9 to 16 tokens each: one compiled shape for prompt_logits, one prefill and one decode step per engine.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [5, 900, 33, 2000, 17, 48000, 7, 7, 3], list(range(100, 116))]


# ---- errors (in this process) -------------------------------------------------------------------------------
def test_sizes_that_do_not_divide_the_heads_name_the_ones_that_do():
    with pytest.raises(ValueError, match=r"^tensor_parallel_size=4 must divide num_attention_heads=9; "
                                         r"sizes that work: 1, 3, 9$"):
        check_tensor_parallel_size(4, 9, 3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=6 must divide num_key_value_heads=4 or be a "
                                         r"multiple of it .*sizes that work: 1, 2, 4, 8, 12, 24$"):
        check_tensor_parallel_size(6, 24, 4)
    assert working_sizes(32, 8) == [1, 2, 4, 8, 16, 32]
    with pytest.raises(ValueError, match="positive integer"):
        check_tensor_parallel_size(0, 9, 3)


def test_engine_names_the_working_sizes_before_looking_at_devices():
    from jvllm import Engine

    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide num_attention_heads=9; "
                                         "sizes that work: 1, 3, 9"):
        Engine(tensor_parallel_size=4)


def test_engine_explains_how_to_get_more_cpu_devices(tiny_models):
    import jax

    from jvllm import Engine

    if jax.device_count() >= 2:
        pytest.skip("this process already has several devices")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 exceeds jax.device_count\(\)=1.*"
                                         r"XLA_FLAGS=--xla_force_host_platform_device_count=2"):
        Engine(tiny_models["llama_gqa"], tensor_parallel_size=2)


def test_encoders_and_multihost_without_a_coordinator_are_refused():
    from jvllm import Engine

    with pytest.raises(ValueError, match="encoder .* one device"):
        Engine("all-MiniLM-L6-v2", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="coordinator"):
        Engine(num_hosts=2, host_rank=1, tensor_parallel_size=4)


def test_shard_reads_repeat_kv_heads_transpose_and_pad():
    """Each block read from the HF tensor equals that block of the fully transformed tensor."""
    import numpy as np

    from jvllm.parallel.sharding import ShardedTensor, TensorParallelPlan
    from models.hf_names import ArraySource

    hd, kv_heads, hidden, vocab = 3, 2, 5, 10
    k_weight = np.arange(kv_heads * hd * hidden, dtype=np.float32).reshape(kv_heads * hd, hidden)  # [out, in]
    embed = np.arange(vocab * hidden, dtype=np.float32).reshape(vocab, hidden)
    plan = TensorParallelPlan(tp=4, kv_repeat=2, head_dim=hd, padded={"vocab": 12})
    source = ArraySource({"k": k_weight, "e": embed})
    k = ShardedTensor(source, "k", True, ("embed", "kv_heads"), plan, np.float32)
    heads = k_weight.T.reshape(hidden, kv_heads, hd)
    full_k = np.repeat(heads, 2, axis=1).reshape(hidden, -1)  # head j of the 4 is original head j // 2
    assert k.shape == full_k.shape == (hidden, 4 * hd)
    for shard in range(4):
        cols = slice(shard * hd, (shard + 1) * hd)
        np.testing.assert_array_equal(k.read((slice(None), cols)), full_k[:, cols])
    e = ShardedTensor(source, "e", False, ("vocab", "embed"), plan, np.float32)
    full_e = np.concatenate([embed, np.zeros((2, hidden), np.float32)])
    assert e.shape == (12, hidden)
    for shard in range(4):
        rows = slice(shard * 3, (shard + 1) * 3)
        np.testing.assert_array_equal(e.read((rows, slice(None))), full_e[rows])


# ---- TP=N against TP=1 (subprocesses with virtual devices) ------------------------------------------------
SAMPLING_CHECKED_ON = ("phi3_fused",)  # at TP 2: the sharded sampler sees vocab-parallel logits, whatever the family

# One family per sharding feature (CI time): per-head q/k norms and the Pallas experts under qwen3_moe (whose layer 1
# is dense); Gemma-2's soft-caps and windows shard as Llama's attention does (the extended run has them). KV heads
# split over the devices: phi3_fused at TP 2; replicated: qwen2_padded at TP 3 (and llama_mqa at TP 4 in the Pallas
# test below); Llama at TP 2 and 4 is extended (the same attention and MLP sharding as phi3_fused and qwen2_padded).
EXTENDED = pytest.mark.extended  # families whose sharding the CI run's families already cover


@pytest.mark.parametrize("name, tps", [pytest.param("llama_gqa", [4], marks=EXTENDED),
                                       pytest.param("llama_gqa", [2], marks=EXTENDED),
                                       pytest.param("llama_mqa", [4], marks=EXTENDED),
                                       ("qwen2_padded", [3]), pytest.param("qwen2_padded", [2], marks=EXTENDED),
                                       ("qwen2_moe_padded", [3]), pytest.param("qwen2_moe_padded", [2], marks=EXTENDED),
                                       ("phi3_fused", [2]), pytest.param("qwen3_moe", [2], marks=EXTENDED),
                                       pytest.param("mistral_window", [2], marks=EXTENDED),
                                       pytest.param("gemma2", [2], marks=EXTENDED),
                                       pytest.param("gemma3", [2], marks=EXTENDED)])
def test_tp_logits_and_greedy_tokens_match_tp1(tiny_models, name, tps):
    # The sharded sampler (seeded sampling, logprobs, token masks) does not depend on the family: checked on one.
    sampling = name in SAMPLING_CHECKED_ON
    result = run_worker("compare", {"model": tiny_models[name], "tps": tps, "prompts": PROMPTS, "sampling": sampling},
                        devices=max(tps))
    for tp, run in result["runs"].items():
        tp = int(tp)
        assert run["max_abs_logit_diff"] < LOGITS_ATOL, (name, tp, run["max_abs_logit_diff"])
        assert run["tokens"] == result["reference_tokens"], (name, tp)
        if sampling:
            assert run["sampled_tokens"] == result["reference_sampled"], (name, tp)  # seeded, temperature 0.8
            assert run["constrained"] == result["reference_constrained"], (name, tp)  # regex-masked, seeded
            assert re.fullmatch("[a-z ]{1,40}", run["constrained"]["text"]), run["constrained"]
            assert run["max_abs_logprob_diff"] < LOGITS_ATOL, (name, tp, run["max_abs_logprob_diff"])
        placed = run["placement"]
        assert placed["largest_block"] * tp == placed["largest_weight"], placed  # no device holds a whole matrix
        assert placed["pool_spec"].startswith("P(None, None, 'tp'"), placed
        assert placed["pool_block"][2] == placed["pool_shape"][2] // tp >= 1, placed


def test_layer_runs_under_tp_match_tp1(tiny_models, monkeypatch):
    """Runs of two layers in one executable (JVLLM_LAYERS_PER_CALL=2): each run's per-layer results keep their
    sharding, the donated pool too, and the tokens are TP=1's."""
    monkeypatch.setenv("JVLLM_LAYERS_PER_CALL", "2")
    result = run_worker("compare", {"model": tiny_models["phi3_fused"], "tps": [2], "prompts": PROMPTS[:2],
                                    "backend": "pallas"}, devices=2)
    assert result["runs"]["2"]["tokens"] == result["reference_tokens"]


def test_pallas_backend_under_tp_matches_tp1(tiny_models):
    """The fused Pallas kernels (interpret mode on CPU) per shard, with 1 KV head replicated over 4 devices."""
    result = run_worker("compare", {"model": tiny_models["llama_mqa"], "tps": [4], "prompts": PROMPTS[:2],
                                    "backend": "pallas"}, devices=4)
    assert result["runs"]["4"]["tokens"] == result["reference_tokens"]


@pytest.mark.parametrize("name", [pytest.param("mixtral", marks=EXTENDED), "qwen3_moe"])
def test_pallas_experts_under_tp_match_tp1(tiny_models, name, monkeypatch):
    """JVLLM_MOE_EXPERTS=pallas in the worker: the grouped-matmul kernel (interpret mode) runs per device on its
    slice of every expert's intermediate width (Qwen3-MoE's 40 -> 20 per device, padded to 32 in the kernel), and
    the psum of the partial sums gives TP=1's logits and tokens (the sharded sampler: the test above)."""
    monkeypatch.setenv("JVLLM_MOE_EXPERTS", "pallas")
    result = run_worker("compare", {"model": tiny_models[name], "tps": [2], "prompts": PROMPTS, "sampling": False},
                        devices=2)
    run = result["runs"]["2"]
    assert run["max_abs_logit_diff"] < LOGITS_ATOL, (name, run["max_abs_logit_diff"])
    assert run["tokens"] == result["reference_tokens"], name


def test_pallas_experts_reduce_once_per_layer(tiny_models, monkeypatch):
    """The shard_map'd experts in Mixtral's compiled decode layer: one all-reduce of [T, D] (the experts' psum)
    beside o_proj's, and nothing gathered: each device's kernel reads only the expert slices it holds."""
    monkeypatch.setenv("JVLLM_MOE_EXPERTS", "pallas")
    out = run_worker("hlo", {"model": tiny_models["mixtral"], "tp": 2, "prompts": PROMPTS}, devices=2)
    activations = {"op": "all-reduce", "shapes": [[out["tokens"], 64]]}
    assert out["layer"] == [activations, activations], out["layer"]


@pytest.mark.parametrize("backend, tp", [("xla", 4), ("pallas", 2)])
def test_decode_step_collectives(tiny_models, backend, tp):
    """One all-reduce for the embedding lookup, two per layer (after o_proj and down_proj; the compiled layer
    serves every layer), one [S, V] logits all-gather for the sampler; no collective of a weight's shape; the
    pool write stays local. q/k/v and gate/up are joined within each device's columns, and splitting their
    outputs moves nothing between devices."""
    out = run_worker("hlo", {"model": tiny_models["llama_gqa"], "tp": tp, "prompts": PROMPTS, "backend": backend},
                     devices=tp)
    assert out["joined_shards"] == {"qkv": [tp] * out["num_layers"], "gate_up": [tp] * out["num_layers"]}, out
    hidden = 64
    activations = {"op": "all-reduce", "shapes": [[out["tokens"], hidden]]}
    assert out["embed"] == [activations], out["embed"]
    assert out["layer"] == [activations, activations], out["layer"]
    assert out["head"] == [{"op": "all-gather", "shapes": [[out["seqs"], out["vocab"]]]}], out["head"]
    weight_shapes = {tuple(s) for s in out["weight_shapes"]}
    every = out["embed"] + out["layer"] + out["head"]
    assert not any(tuple(s) in weight_shapes for c in every for s in c["shapes"])
    if backend == "xla":
        assert out["store_kv"] == [], out["store_kv"]


@pytest.mark.slow
@EXTENDED  # its sharding (phi3_fused, qwen2_padded at tp=3) and the Llama family (llama_mqa under Pallas) above
def test_smollm2_tp3_greedy_tokens_match_tp1():
    """The default model (9 heads, 3 KV heads, 30 layers): 4 prompts of ~16 tokens, submitted together."""
    from transformers import AutoTokenizer

    from jvllm.model_loader.default_model import default_model_path
    from jvllm.model_loader.loader import _gguf_as_hf_folder

    tok = AutoTokenizer.from_pretrained(str(_gguf_as_hf_folder(default_model_path())))
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
             "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"]
    prompts = [tok.encode(t) for t in texts]
    result = run_worker("compare", {"model": None, "tps": [3], "prompts": prompts, "max_tokens": 16,
                                    "engine": {"kv_cache_memory_bytes": 32 << 20}}, devices=3)
    run = result["runs"]["3"]
    assert run["tokens"] == result["reference_tokens"]
    assert run["max_abs_logit_diff"] < 1e-3, run["max_abs_logit_diff"]  # 30 layers, logits up to ~30
