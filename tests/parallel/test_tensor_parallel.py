"""Tensor parallelism on virtual CPU devices: TP=N matches TP=1, the sharded step's collectives, multi-host.

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

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys

import pytest

from jvllm.parallel.mesh import check_tensor_parallel_size, working_sizes
from tests.hf_weights import save_random_model

REPO = pathlib.Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "parallel" / "tp_worker.py"
RESULT_PREFIX = "TP_WORKER_RESULT "
LOGITS_ATOL = 1e-4
WORKER_TIMEOUT_S = 600
# 9 to 16 tokens each: one compiled shape for prompt_logits, one prefill and one decode step per engine.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [5, 900, 33, 2000, 17, 48000, 7, 7, 3], list(range(100, 116))]

# name -> (transformers kind, config overrides): GQA, MQA (1 KV head: replicated at TP=4), and Qwen2 with
# q/k/v biases, tied embeddings, a vocabulary (49155) and MLP width (100) that TP=2 / TP=3 must pad.
TINY = {
    "llama_gqa": ("llama", {}),
    "llama_mqa": ("llama", {"num_key_value_heads": 1}),
    "qwen2_padded": ("qwen2", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 1,
                               "intermediate_size": 100, "vocab_size": 49155, "tie_word_embeddings": True}),
    # experts split along their intermediate width (40 and the shared expert's 50: padded at TP=3)
    "qwen2_moe_padded": ("qwen2_moe", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 1,
                                       "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
                                       "shared_expert_intermediate_size": 50, "norm_topk_prob": False}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # q/k/v and gate/up read as row ranges of fused tensors; the MLP width 101 is padded at TP=2
    "phi3_fused": ("phi3", {"intermediate_size": 101, "partial_rotary_factor": 0.5, "pad_token_id": 0}),
    # per-head q/k norms, and experts with dense layers mixed in
    "qwen3_moe": ("qwen3_moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 40, "norm_topk_prob": True, "mlp_only_layers": [1]}),
    # Mistral: every layer attends to the last 8 tokens only (the prompts are 9-16 long)
    "mistral_window": ("mistral", {"sliding_window": 8}),
    # sliding (8 tokens) and full layers, attention and final soft-caps, tied embeddings
    "gemma2": ("gemma2", {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 8, "query_pre_attn_scalar": 24,
                          "attn_logit_softcapping": 4.0, "final_logit_softcapping": 6.0, "pad_token_id": 0,
                          "tie_word_embeddings": True}),
    # q/k norms, two RoPE bases, one KV head replicated at TP=2
    "gemma3": ("gemma3", {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 8, "num_key_value_heads": 1,
                          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                          "pad_token_id": 0}),
}


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["HF_HUB_OFFLINE"] = "1"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _result(stdout: str, stderr: str, returncode: int) -> dict:
    assert returncode == 0, f"worker failed ({returncode}):\n{stderr[-4000:]}"
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert lines, f"no result line:\n{stdout[-2000:]}\n{stderr[-2000:]}"
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def run_worker(scenario: str, args: dict, devices: int) -> dict:
    proc = subprocess.run([sys.executable, str(WORKER), scenario, json.dumps({**args, "devices": devices})],
                          env=_env(devices), cwd=REPO, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    return _result(proc.stdout, proc.stderr, proc.returncode)


def run_together(commands: list[list[str]], devices: int) -> list[tuple[str, str, int]]:
    """Start every command at once (one process group each); kill them all if one outlives the timeout."""
    procs = [subprocess.Popen(cmd, env=_env(devices), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for cmd in commands]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=WORKER_TIMEOUT_S)
            results.append((out, err, proc.returncode))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """name -> folder of a tiny random HF model (weights std 0.2, norms 1 +- 0.2, biases +- 0.2, so that a
    wrong shard, head order or bias moves the logits far above the tolerance) with SmolLM2's tokenizer."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jvllm.model_loader.default_model import default_model_path
    from jvllm.model_loader.loader import _gguf_as_hf_folder

    tokenizer_folder = _gguf_as_hf_folder(default_model_path())
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
               "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
               "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
               "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
               "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
               "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
               "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)}
    folders = {}
    for name, (kind, overrides) in TINY.items():
        settings = {**dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           bos_token_id=1, eos_token_id=2, tie_word_embeddings=False), **overrides}
        folder = tmp_path_factory.mktemp(f"tp-{name}")
        save_random_model(*classes[kind], settings, folder, tokenizer_folder)
        folders[name] = str(folder)
    return folders


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
SAMPLING_CHECKED_ON = ("llama_gqa", "qwen2_moe_padded")  # a dense model at TP 2/4 and a padded MoE at TP 2/3

# One family per sharding feature (CI time): Mixtral's experts run under the pallas experts test below, per-head q/k
# norms under qwen3_moe (whose layer 1 is dense).
@pytest.mark.parametrize("name, tps", [("llama_gqa", [2, 4]), ("llama_mqa", [4]), ("qwen2_padded", [2, 3]),
                                       ("qwen2_moe_padded", [2, 3]), ("phi3_fused", [2]), ("qwen3_moe", [2]),
                                       ("mistral_window", [2]), ("gemma2", [2]), ("gemma3", [2])])
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


def test_pallas_backend_under_tp_matches_tp1(tiny_models):
    """The fused Pallas kernels (interpret mode on CPU) per shard, with 1 KV head replicated over 4 devices."""
    result = run_worker("compare", {"model": tiny_models["llama_mqa"], "tps": [4], "prompts": PROMPTS[:2],
                                    "backend": "pallas"}, devices=4)
    assert result["runs"]["4"]["tokens"] == result["reference_tokens"]


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_pallas_experts_under_tp_match_tp1(tiny_models, name, monkeypatch):
    """JVLLM_MOE_EXPERTS=pallas in the worker: the grouped-matmul kernel (interpret mode) runs per device on its
    slice of every expert's intermediate width (Qwen3-MoE's 40 -> 20 per device, padded to 32 in the kernel), and
    the psum of the partial sums gives TP=1's logits and tokens."""
    monkeypatch.setenv("JVLLM_MOE_EXPERTS", "pallas")
    result = run_worker("compare", {"model": tiny_models[name], "tps": [2], "prompts": PROMPTS}, devices=2)
    run = result["runs"]["2"]
    assert run["max_abs_logit_diff"] < LOGITS_ATOL, (name, run["max_abs_logit_diff"])
    assert run["tokens"] == result["reference_tokens"], name
    assert run["sampled_tokens"] == result["reference_sampled"], name
    assert run["max_abs_logprob_diff"] < LOGITS_ATOL, (name, run["max_abs_logprob_diff"])


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
    pool write stays local."""
    out = run_worker("hlo", {"model": tiny_models["llama_gqa"], "tp": tp, "prompts": PROMPTS, "backend": backend},
                     devices=tp)
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


# ---- multi-host ---------------------------------------------------------------------------------------------
def test_step_channel_framing(monkeypatch):
    """Messages of any size, heartbeats and shutdown survive the fixed-size first broadcast (+ remainder),
    with the follower passing buffers of exactly the leader's shapes (a collective's requirement)."""
    import numpy as np

    from jvllm.parallel import distributed

    wire: list[np.ndarray] = []
    monkeypatch.setattr(distributed, "broadcast_from_leader", lambda value: wire.append(value.copy()) or value)
    leader, follower = distributed.StepChannel(), distributed.StepChannel()
    follower.is_leader = False
    messages = [{"ids": np.arange(5)}, {"big": np.arange(50_000, dtype=np.int32)}, "x" * 16_368]
    for message in messages:
        leader.heartbeat()
        leader.send(message)
    leader.shutdown()
    leader.shutdown()  # idempotent
    sent = list(wire)

    def replay(value: np.ndarray) -> np.ndarray:
        recorded = sent.pop(0)
        assert (recorded.shape, recorded.dtype) == (value.shape, value.dtype)
        return recorded
    monkeypatch.setattr(distributed, "broadcast_from_leader", replay)
    got = [follower.receive() for _ in messages]
    assert follower.receive() is None and not sent
    np.testing.assert_array_equal(got[0]["ids"], messages[0]["ids"])
    np.testing.assert_array_equal(got[1]["big"], messages[1]["big"])
    assert got[2] == messages[2]


def test_two_processes_form_one_tp4_mesh_and_match_a_single_process(tiny_models):
    """2 processes x 2 CPU devices on loopback, gloo collectives: rank 0 generates, rank 1 follows its
    steps and exits when rank 0 shuts down; tokens equal a single process's TP=1 tokens."""
    model = tiny_models["llama_gqa"]
    reference = run_worker("generate", {"model": model, "prompts": PROMPTS}, devices=1)
    coordinator = f"127.0.0.1:{free_port()}"
    commands = [[sys.executable, str(WORKER), "multihost",
                 json.dumps({"model": model, "tp": 4, "num_hosts": 2, "rank": rank, "coordinator": coordinator,
                             "prompts": PROMPTS})] for rank in (0, 1)]
    leader, follower = [_result(*r) for r in run_together(commands, devices=2)]
    assert (leader["devices"], leader["local_devices"]) == (4, 2)
    assert leader["tokens"] == reference["tokens"]
    assert follower["steps_followed"] > 0


def _serve_once(command_for_rank, prompt: str, http_port: int) -> tuple[str, list[int]]:
    """Start both ranks of `jvllm serve`, ask rank 0's HTTP server for one greedy completion, SIGTERM rank 0;
    -> (the completion's text, both ranks' exit codes)."""
    import time
    import urllib.request

    procs = [subprocess.Popen(command_for_rank(rank), env=_env(2), cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for rank in (0, 1)]
    try:
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while True:
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:] for p in procs]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5)
                break
            except OSError:
                time.sleep(1)
        body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        text = json.load(urllib.request.urlopen(request, timeout=120))["choices"][0]["text"]
        procs[0].send_signal(signal.SIGTERM)  # rank 0 drains, stops, and releases rank 1
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return text, codes


def test_cli_generate_and_serve_across_two_hosts_match_one(tiny_models):
    """`jvllm generate|serve --num-hosts 2 --host-rank R --coordinator ...`: rank 0 prints (or serves) the
    single-process text, rank 1 prints nothing; SIGTERM to the server's rank 0 ends both ranks with 0."""
    prompt = "The quick brown fox"
    engine_flags = ["--model", tiny_models["llama_gqa"], "--dtype", "float32", "--kv-cache-memory-bytes", "4m",
                    "--max-model-len", "128", "--no-precompile"]  # only the shapes met: a quicker start
    base = [sys.executable, "-m", "entrypoints.cli", "generate", prompt, "--max-tokens", "8", *engine_flags]
    single = run_together([base], devices=1)[0]
    assert single[2] == 0, single[1][-3000:]
    assert single[0].strip()

    def multihost(rank: int, coordinator: str) -> list[str]:
        return ["-tp", "4", "--num-hosts", "2", "--host-rank", str(rank), "--coordinator", coordinator]

    coordinator = f"127.0.0.1:{free_port()}"
    ranks = run_together([base + multihost(rank, coordinator) for rank in (0, 1)], devices=2)
    assert [r[2] for r in ranks] == [0, 0], [r[1][-3000:] for r in ranks]
    # gloo's C++ code logs its connections to stdout (from several threads, so even its lines can be cut
    # up), before the text, which is printed once generation is done
    assert ranks[0][0].endswith(single[0]) and single[0].strip() not in ranks[1][0]

    coordinator, http_port = f"127.0.0.1:{free_port()}", free_port()
    serve = [sys.executable, "-m", "entrypoints.cli", "serve", *engine_flags, "--port", str(http_port)]
    text, codes = _serve_once(lambda rank: serve + multihost(rank, coordinator), prompt, http_port)
    assert text == single[0].rstrip("\n")
    assert codes == [0, 0]
