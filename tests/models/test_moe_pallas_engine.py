"""The engine's MoE layers on the Pallas grouped-matmul kernel (JVLLM_MOE_EXPERTS=pallas, interpret mode on the CPU)
against its default CPU expert path: a tiny random Mixtral and Qwen3-MoE (expert width 40: zero-padded to the
kernel's multiple of 16), prompt logits at every position within 1e-4 and batched greedy decoding token for token,
with uneven expert loads (checked through transformers' router)."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jvllm import Engine, SamplingParams  # noqa: E402
from models import moe  # noqa: E402
from tests.hf_weights import save_random_model  # noqa: E402
from tests.models.test_family_parity import _expert_loads  # noqa: E402
from tests.prompt_logits import prompt_logits  # noqa: E402

LOGITS_ATOL = 1e-4
BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                       norm_topk_prob=True, mlp_only_layers=[1])),
}
_rng = np.random.default_rng(3)
PROMPTS = [_rng.integers(3, 49152, n).tolist() for n in (5, 17, 37)]  # page boundaries (16) inside the prompts


@pytest.fixture(scope="module")
def moe_models(smollm_tokenizer_dir, tmp_path_factory) -> dict[str, tuple[pathlib.Path, object]]:
    """name -> (folder, transformers model): random weights redrawn large (std 0.2), SmolLM2's tokenizer."""
    built = {}
    for name, (config_name, model_name, overrides) in FAMILIES.items():
        folder = tmp_path_factory.mktemp(f"moe-{name}")
        built[name] = (folder, save_random_model(getattr(transformers, config_name), getattr(transformers, model_name),
                                                 {**BASE, **overrides}, folder, smollm_tokenizer_dir))
    return built


def _engine(folder: pathlib.Path) -> Engine:
    return Engine(str(folder), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=128, max_num_seqs=4,
                  enable_prefix_caching=False, precompile=False)


def _run(engine: Engine) -> tuple[list[np.ndarray], list[list[int]]]:
    """(logits [n, V] of every prompt position, 12 greedy tokens per prompt, the prompts batched)."""
    logits = [prompt_logits(engine.runner, p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return logits, [list(o.outputs[0].token_ids) for o in outputs]


# Mixtral's experts take the same kernel as Qwen3-MoE's (whose layer 1 is dense besides): extended
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.extended) if name == "mixtral" else name
                                  for name in FAMILIES])
def test_pallas_experts_match_the_default_path(name, moe_models, monkeypatch):
    folder, hf_model = moe_models[name]
    monkeypatch.delenv(moe.EXPERTS_ENV, raising=False)
    monkeypatch.delenv("JVLLM_PALLAS_INTERPRET", raising=False)  # interpret mode: the CPU default
    assert moe.expert_implementation() == "tiles"
    want_logits, want_tokens = _run(_engine(folder))

    launches: list[tuple[int, ...]] = []  # the (lhs rows, columns) of each kernel call traced

    def counting(lhs, rhs, group_sizes, **kwargs):
        launches.append((lhs.shape[0], rhs.shape[2]))
        return grouped_matmul(lhs, rhs, group_sizes, **kwargs)

    grouped_matmul = moe.grouped_matmul
    monkeypatch.setattr(moe, "grouped_matmul", counting)
    monkeypatch.setenv(moe.EXPERTS_ENV, "pallas")
    got_logits, got_tokens = _run(_engine(folder))

    assert launches and len(launches) % 3 == 0, launches  # gate, up, down per MoE layer traced
    hidden, width = BASE["hidden_size"], FAMILIES[name][2].get("moe_intermediate_size", BASE["intermediate_size"])
    padded = -(-width // 16) * 16
    assert {columns for _, columns in launches} == {padded, hidden}
    for prompt, got, want in zip(PROMPTS, got_logits, want_logits):
        assert got.shape == want.shape == (len(prompt), BASE["vocab_size"])
        np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_ATOL)
    assert got_tokens == want_tokens
    for load in _expert_loads(hf_model, PROMPTS[-1]):  # the ragged groups really differ in size
        assert load.sum() == 2 * len(PROMPTS[-1]) and load.max() - load.min() >= 4, load


def test_unknown_implementation_is_refused(monkeypatch):
    monkeypatch.setenv(moe.EXPERTS_ENV, "cuda")
    with pytest.raises(ValueError, match="JVLLM_MOE_EXPERTS='cuda': expected one of pallas, ragged, tiles"):
        moe.expert_implementation()
