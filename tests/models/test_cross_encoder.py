"""Cross-encoders: a tiny random BertForSequenceClassification (transformers, saved with a BERT tokenizer) scored by
Engine.score against sentence-transformers' CrossEncoder (PyTorch): N-to-N and 1-to-N pairs of uneven lengths, a
pair over the token limit, token types, the score activation, nothing compiled after start, refusals."""
from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
import torch
import transformers

from jvllm import Engine
from jvllm.model_loader.embedded_models import embedded_model_path, find_embedded_model
from jvllm.outputs import ScoringRequestOutput
from jvllm.worker.compile_watch import compile_watch

TINY = dict(vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128, type_vocab_size=2, initializer_range=0.2)
LONG = " ".join(f"clause {i} of a document longer than the model's limit" for i in range(30))  # > 128 tokens
QUERIES = ["what is the capital of france", "", "北京是中华人民共和国的首都", "paris", "how do boats float?",
           "a", "the quick brown fox jumps over the lazy dog " * 3, LONG]
DOCUMENTS = ["paris", "what is the capital of france", "Москва — столица России.", "", "buoyancy: displaced water",
             "🎉🚀 emoji", "a", "short"]


def save_tiny_cross_encoder(path: pathlib.Path) -> pathlib.Path:
    """A tiny cross-encoder in `path`: random weights scaled so scores spread over (0, 1) and token types matter."""
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=1, **TINY)).eval()
    with torch.no_grad():
        model.classifier.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    tokenizer = embedded_model_path(find_embedded_model("all-MiniLM-L6-v2"))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(f"{tokenizer}/{name}", path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_cross_encoder(tmp_path_factory.mktemp("cross-encoder"))


# An encoder runs no paged attention: naming a backend skips building the native kernels for nothing.
ENGINE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=256, attention_backend="xla")


@pytest.fixture(scope="module")
def engine(folder):
    """Precompiled, with limits that keep its bucket shapes few."""
    return Engine(str(folder), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def cross_encoder(folder):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(folder), device="cpu")


def scores(outputs: list[ScoringRequestOutput]) -> np.ndarray:
    assert all(isinstance(out, ScoringRequestOutput) and out.finished for out in outputs)
    return np.array([out.outputs.score for out in outputs])


def test_n_to_n_scores_match_cross_encoder_with_no_compile_after_start(engine, cross_encoder):
    watch = compile_watch()
    before = watch.total
    ours = scores(engine.score(QUERIES, DOCUMENTS, use_tqdm=False))
    assert watch.total == before, "scoring compiled an executable after start-up"
    theirs = cross_encoder.predict(list(zip(QUERIES, DOCUMENTS)))
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    assert ours.std() > 0.05  # the scores spread: the comparison sees the model


def test_one_to_n_scores_match_cross_encoder_and_the_tokenizer_pairs(engine, cross_encoder, folder):
    query = QUERIES[0]
    outputs = engine.score(query, DOCUMENTS, use_tqdm=False)
    np.testing.assert_allclose(scores(outputs), cross_encoder.predict([(query, d) for d in DOCUMENTS]), atol=1e-4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert [out.prompt_token_ids for out in outputs] == tokenizer([query] * len(DOCUMENTS), DOCUMENTS)["input_ids"]
    assert scores(engine.score([query], DOCUMENTS[:1], use_tqdm=False))[0] == pytest.approx(scores(outputs)[0])


def test_a_long_pair_is_truncated_longest_first_like_the_cross_encoder(engine, cross_encoder):
    out = engine.score(LONG, LONG, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == engine.config.max_model_len == 128
    assert out.outputs.score == pytest.approx(float(cross_encoder.predict([(LONG, LONG)])[0]), abs=1e-4)
    with pytest.raises(ValueError, match="pair 0 has"):
        engine.score(LONG, LONG, truncate=False, use_tqdm=False)
    short = engine.score(LONG, LONG, truncate_prompt_tokens=20, use_tqdm=False)[0]
    assert len(short.prompt_token_ids) == 20


def test_token_types_matter_to_the_reference(cross_encoder):
    """The pairs' second texts have token type 1: a model that ignored types would miss the reference by far."""
    pairs = list(zip(QUERIES, DOCUMENTS))
    theirs = cross_encoder.predict(pairs)
    types = cross_encoder.model.bert.embeddings.token_type_embeddings.weight
    saved = types.detach().clone()
    try:
        with torch.no_grad():
            types[1] = types[0]
        assert np.abs(cross_encoder.predict(pairs) - theirs).max() > 1e-2
    finally:
        with torch.no_grad():
            types.copy_(saved)


def test_the_configured_activation_is_applied(folder, tmp_path):
    """A config naming torch's Identity (as ms-marco cross-encoders do) gives the raw logit: logit(sigmoid score)."""
    shutil.copytree(folder, tmp_path / "identity")
    config = json.loads((tmp_path / "identity" / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (tmp_path / "identity" / "config.json").write_text(json.dumps(config))
    raw = Engine(str(tmp_path / "identity"), precompile=False, **ENGINE_ARGS)
    logits = scores(raw.score(QUERIES[0], DOCUMENTS[:3], use_tqdm=False))
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(tmp_path / "identity"), device="cpu")
    np.testing.assert_allclose(logits, reference.predict([(QUERIES[0], d) for d in DOCUMENTS[:3]]), atol=1e-4)
    assert not np.all((logits > 0) & (logits < 1))  # not squashed


def test_refusals(engine):
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        engine.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    with pytest.raises(ValueError, match="at least one text"):
        engine.score([], ["c"], use_tqdm=False)
    with pytest.raises(ValueError, match="string or a list of strings"):
        engine.score("a", [1, 2], use_tqdm=False)
    with pytest.raises(ValueError, match="cross-encoder.*does not embed"):
        engine.embed("a", use_tqdm=False)
    with pytest.raises(ValueError, match="cross-encoder: it cannot generate"):
        engine.generate("a", use_tqdm=False)


def test_roberta_classification_head_matches_transformers(tmp_path):
    """RoBERTa-family checkpoints name the head classifier.dense / classifier.out_proj: the same logits."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jvllm.model_loader.loader import load_model

    torch.manual_seed(1)
    config = transformers.RobertaConfig(**{**TINY, "type_vocab_size": 1, "max_position_embeddings": 130}, num_labels=1)
    model = transformers.RobertaForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer = embedded_model_path(find_embedded_model("all-MiniLM-L6-v2"))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(f"{tokenizer}/{name}", tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32")
    assert loaded.is_cross_encoder and loaded.config.num_labels == 1

    @jax.jit
    def logits(state, ids: jax.Array, mask: jax.Array) -> jax.Array:  # [B, L] -> [B, 1]
        model = nnx.merge(loaded.graphdef, state)
        return model.classify(model(ids, mask)[:, 0])

    rng = np.random.default_rng(0)
    ids = rng.integers(5, TINY["vocab_size"], (3, 12))
    mask = np.ones_like(ids)
    mask[1, 7:] = 0  # a padded row
    ids[1, 7:] = config.pad_token_id
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    ours = logits(loaded.state, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32))
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=2e-5)
