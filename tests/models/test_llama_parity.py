"""Numerical parity of jvllm's Llama-family model with transformers (PyTorch, float32).

* SmolLM2-135M-Instruct (the default model, from its GGUF): greedy generation of 8 prompts of very
  different lengths, submitted together in one batch, matches transformers token for token.
* Tiny random Llama / Qwen2 / Mistral configs (llama3 rope scaling, tied embeddings, MHA): the logits
  of every prompt position match transformers to a stated float32 tolerance, and greedy generation
  through the paged decode path matches too.
* An architecture jvllm does not implement is rejected with a ValueError naming the supported ones.

The tiny models start from `tiny_model_factory` (config + tokenizer) but their weights are redrawn
here with a larger scale, and with non-trivial RMSNorm weights and biases: transformers initialises
norms to 1 and biases to 0, and with its default 0.02 init attention is almost uniform, so a wrong
rope, a swapped norm or a dropped bias would hardly move the logits. The redrawn weights make each of
those mistakes visible far above the tolerance (checked below for the rope scaling).
"""
from __future__ import annotations

import copy
import json
import pathlib
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jvllm import Engine, SamplingParams  # noqa: E402
from tests.hf_weights import redraw_weights  # noqa: E402
from tests.prompt_logits import prompt_logits  # noqa: E402

# Float32 on both sides; the tiny models' logits have std ~1.6 and max |logit| ~9. Measured max abs
# difference: ~1.7e-5 (summation order differs between XLA and PyTorch), so 5e-5 leaves 3x headroom
# while any real bug (wrong rope, missing bias, swapped norm) moves logits by >1e-1.
LOGITS_ATOL = 5e-5
# Greedy divergence is only tolerated where the reference itself hesitates (top-2 logit gap below this).
NEAR_TIE_GAP = 1e-3

GENERATION_TEXTS = [
    "Hello there, how are you doing today? I hope the weather is nice where you live.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "for i in range(10):\n    print(i, fibonacci(i))\n",
    "The mitochondria is the powerhouse of the cell. It produces adenosine triphosphate through a process "
    "called oxidative phosphorylation, which takes place across the inner mitochondrial membrane.",
    "Prices rose 3.7% in 2023, while wages grew by 4.1%; economists at 12 banks expect 2.5% inflation "
    "by the end of 2025, with unemployment near 3.9 percent and GDP growth of 1.8 percent.",
    "Il était une fois, dans un petit village au bord de la mer, une jeune fille qui rêvait de voyager "
    "autour du monde. Chaque matin, elle regardait les bateaux partir vers l'horizon.",
    "<|im_start|>user\nWrite a short poem about the ocean and the moon.<|im_end|>\n<|im_start|>assistant\n",
    "Q: What is the capital of Australia?\nA: Canberra.\nQ: What is the largest planet in the solar "
    "system?\nA: Jupiter.\nQ: Who wrote the novel Pride and Prejudice?\nA:",
    "In the beginning of the twentieth century, physics underwent two revolutions. Relativity changed "
    "our understanding of space and time, and quantum mechanics described the behaviour of atoms. "
    "Einstein, Bohr, Heisenberg and Schrödinger argued for decades about what the new theory meant, "
    "and whether the world was fundamentally random. Experiments by Aspect and others later showed "
    "that local hidden variables cannot explain the correlations between entangled particles. Today the "
    "same ideas underpin quantum computers, which store information in superpositions of qubits and "
    "promise to factor large numbers, simulate molecules and search databases faster than any classical "
    "machine, provided that the fragile quantum states can be protected from noise for long enough.",
]
PROMPT_LENGTHS = [12, 40, 20, 60, 52, 3, 33, 120]  # one per text, all different, crossing several pages

LOGITS_TEXT = ("The history of natural language processing generally started in the 1950s, although work "
               "can be found from earlier periods. In 1950, Alan Turing published an article titled")

LLAMA3_ROPE = dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                   rope_theta=500000.0)
YARN_ROPE = dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                               "beta_fast": 16, "beta_slow": 1})
TINY_CONFIGS = {
    "llama": ("llama", {}),
    "llama_yarn_rope_scaling": ("llama", YARN_ROPE),
    "qwen2_linear_rope_scaling": ("qwen2", {"rope_scaling": {"rope_type": "linear", "factor": 3.0}}),
    "qwen2_qkv_bias": ("qwen2", {}),
    "mistral": ("mistral", {}),
    "llama3_rope_scaling": ("llama", LLAMA3_ROPE),
    "llama_tied_embeddings": ("llama", {"tie_word_embeddings": True}),
    "llama_mha": ("llama", {"num_key_value_heads": 4}),
}
_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


# ---- helpers ------------------------------------------------------------------------------------
def _build_prompts(tokenizer) -> list[list[int]]:
    prompts = []
    for index, length in enumerate(PROMPT_LENGTHS):
        ids = tokenizer.encode(GENERATION_TEXTS[index])
        assert len(ids) >= length, f"text {index} has only {len(ids)} tokens, need {length}"
        prompts.append(ids[:length])
    return prompts


def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], np.ndarray]:
    """transformers greedy generation, batch 1, no EOS stopping -> (new ids, raw logits [N, V])."""
    config = copy.deepcopy(model.generation_config)
    config.do_sample = False
    config.max_new_tokens = max_new_tokens
    config.min_new_tokens = None
    config.eos_token_id = None  # generate exactly max_new_tokens, like ignore_eos=True
    config.pad_token_id = 0
    config.output_logits = True
    config.return_dict_in_generate = True
    for name in ("temperature", "top_p", "top_k", "repetition_penalty"):
        if hasattr(config, name):
            setattr(config, name, None)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    new = out.sequences[0, len(prompt):].tolist()
    assert len(new) == max_new_tokens, "the reference stopped early: EOS stopping was not disabled"
    return new, torch.stack(out.logits)[:, 0].float().numpy()


def _assert_greedy_match(got: list[int], want: list[int], ref_logits: np.ndarray, label: str) -> None:
    """Identical ids, or a first divergence exactly where the reference's top-2 gap is a near tie."""
    assert len(got) == len(want), f"{label}: jvllm made {len(got)} tokens, transformers {len(want)}"
    if got == want:
        return
    first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    top2 = np.sort(ref_logits[first])[-2:]
    gap = float(top2[1] - top2[0])
    assert gap < NEAR_TIE_GAP, (
        f"{label}: greedy ids diverge at step {first} (jvllm {got[first]}, transformers {want[first]}) "
        f"where the reference's top-2 logit gap is {gap:.3g} (not a near tie)\njvllm: {got}\nref:   {want}")


def assert_prompt_logits_match(engine: Engine, hf_model, ids: list[int]) -> None:
    """jvllm's logits at every prompt position against transformers' (float32), within LOGITS_ATOL."""
    got = prompt_logits(engine.runner, ids)
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0].float().numpy()
    assert got.shape == want.shape == (len(ids), 49152)
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_ATOL)


def _randomized_copy(folder: pathlib.Path, dest: pathlib.Path, kind: str, seed: int = 1):
    """Redraw every weight of a tiny model (std 0.2, norms 1 +- 0.2, biases +- 0.2) into `dest`;
    -> the transformers model holding those weights (float32, eval)."""
    model_cls = getattr(transformers, _HF_CLASSES[kind])
    model = model_cls.from_pretrained(folder, dtype=torch.float32).eval()
    redraw_weights(model, seed)
    model.save_pretrained(dest)
    for item in folder.iterdir():  # tokenizer files
        if item.is_file() and not (dest / item.name).exists():
            shutil.copy(item, dest / item.name)
    return model


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_models(tiny_model_factory, tmp_path_factory):
    """name -> (folder, transformers model) for each TINY_CONFIGS entry, built on first use."""
    built: dict[str, tuple[pathlib.Path, object]] = {}

    def get(name: str):
        if name not in built:
            kind, overrides = TINY_CONFIGS[name]
            source = tiny_model_factory(kind, **copy.deepcopy(overrides))
            dest = tmp_path_factory.mktemp(f"parity-{name}")
            built[name] = (dest, _randomized_copy(source, dest, kind))
        return built[name]

    return get


def _tiny_engine(folder: pathlib.Path) -> Engine:
    return Engine(str(folder), dtype="float32", kv_cache_memory_bytes=16 << 20, precompile=False)  # numbers only


# ---- SmolLM2-135M greedy parity -----------------------------------------------------------------
def test_smollm2_batched_greedy_generation_matches_transformers_token_for_token(default_engine, hf_smollm):
    prompts = _build_prompts(default_engine.get_tokenizer())
    assert len(set(map(len, prompts))) == len(prompts) >= 8
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = default_engine.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    for index, (ids, output) in enumerate(zip(prompts, outputs)):
        completion = output.outputs[0]
        assert completion.finish_reason == "length"
        want, ref_logits = _hf_greedy(hf_smollm, ids, 32)
        _assert_greedy_match(completion.token_ids, want, ref_logits, f"prompt {index} ({len(ids)} tokens)")
    assert default_engine.pages.num_free_pages == default_engine.pages.num_usable_pages


def test_smollm2_prompt_logits_match_transformers(default_engine, hf_smollm):
    ids = default_engine.get_tokenizer().encode(LOGITS_TEXT)
    got = prompt_logits(default_engine.runner, ids)
    with torch.no_grad():
        want = hf_smollm(torch.tensor([ids])).logits[0].float().numpy()
    assert got.shape == want.shape
    # 30 layers in float32 accumulate more rounding than the 2-layer models: logits reach ~42 and the
    # measured max abs difference is ~1.4e-4, so the tolerance is 5e-4.
    np.testing.assert_allclose(got, want, rtol=0, atol=5e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()


# ---- tiny random configs: logits ----------------------------------------------------------------
@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_tiny_model_prompt_logits_match_transformers(name, tiny_models, default_engine):
    folder, hf_model = tiny_models(name)
    ids = default_engine.get_tokenizer().encode(LOGITS_TEXT)[:40]
    assert len(ids) >= 35
    assert_prompt_logits_match(_tiny_engine(folder), hf_model, ids)


@pytest.mark.parametrize("name, rope_type", [("llama3_rope_scaling", "llama3"), ("llama_yarn_rope_scaling", "yarn")])
def test_rope_scaling_parity_is_sensitive_to_the_scaling(tiny_models, default_engine, name, rope_type):
    """Guards the scaled cases above: dropping the scaling would change the logits far beyond the tolerance."""
    folder, hf_model = tiny_models(name)
    config = json.loads((folder / "config.json").read_text())
    parameters = config.get("rope_parameters") or config.get("rope_scaling")
    assert parameters["rope_type"] == rope_type
    plain_config = copy.deepcopy(hf_model.config)
    plain_config.rope_parameters = {"rope_type": "default", "rope_theta": parameters.get("rope_theta", 10000.0)}
    plain = transformers.LlamaForCausalLM(plain_config).eval()
    plain.load_state_dict(hf_model.state_dict())
    ids = torch.tensor([default_engine.get_tokenizer().encode(LOGITS_TEXT)[:40]])
    with torch.no_grad():
        scaled_logits, plain_logits = hf_model(ids).logits, plain(ids).logits
    assert float((scaled_logits - plain_logits).abs().max()) > 100 * LOGITS_ATOL


# ---- tiny random llama: generation through the paged decode path -------------------------------
def test_tiny_llama_batched_greedy_generation_matches_transformers(tiny_models, default_engine):
    folder, hf_model = tiny_models("llama")
    tokenizer = default_engine.get_tokenizer()
    # 5, 17 and 30 prompt tokens: page boundaries (16) fall inside prompts and inside generation.
    prompts = [tokenizer.encode(GENERATION_TEXTS[i])[:n] for i, n in ((0, 5), (2, 17), (7, 30))]
    assert [len(p) for p in prompts] == [5, 17, 30]
    engine = _tiny_engine(folder)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = engine.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    for index, (ids, output) in enumerate(zip(prompts, outputs)):
        want, ref_logits = _hf_greedy(hf_model, ids, 16)
        assert len(output.outputs[0].token_ids) == 16
        _assert_greedy_match(output.outputs[0].token_ids, want, ref_logits, f"tiny prompt {index}")
    assert engine.pages.num_free_pages == engine.pages.num_usable_pages
    engine.pages.check_integrity()


# ---- unsupported architecture -------------------------------------------------------------------
def test_unsupported_architecture_raises_value_error_listing_supported(tmp_path):
    config = {"architectures": ["FooForCausalLM"], "model_type": "foo", "vocab_size": 128, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        Engine(str(tmp_path), dtype="float32", kv_cache_memory_bytes=1 << 20)
    message = str(info.value)
    assert "FooForCausalLM" in message
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert supported in message


# ---- known gap: sliding-window attention --------------------------------------------------------
def test_mistral_sliding_window_is_honoured_or_rejected(tiny_model_factory, tmp_path, default_engine):
    """A Mistral config with sliding_window=16 and a 40-token prompt: transformers masks keys older than
    16 positions; ignoring the window made logits differ by ~9 (max |logit| ~8)."""
    source = tiny_model_factory("mistral", sliding_window=16)
    hf_model = _randomized_copy(source, tmp_path, "mistral")
    ids = default_engine.get_tokenizer().encode(LOGITS_TEXT)[:40]
    try:
        engine = _tiny_engine(tmp_path)
    except ValueError as error:
        assert "sliding" in str(error).lower()
        return
    got = prompt_logits(engine.runner, ids)
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0].float().numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_ATOL)
