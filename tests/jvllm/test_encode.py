"""vLLM's LLM.encode and PoolingParams on all-MiniLM-L6-v2: the vectors embed() gives, as NumPy arrays, with the
options passed in PoolingParams."""
from __future__ import annotations

import numpy as np
import pytest

from jvllm import PoolingParams

TEXTS = ["A cat sits on the mat.", "one two three four five six seven eight"]


@pytest.fixture(scope="module")
def engine():
    from jvllm import Engine

    return Engine("all-MiniLM-L6-v2", precompile=False)  # the shapes these tests meet compile when first met


def test_encode_gives_embed_vectors_as_arrays(engine):
    embedded = engine.embed(TEXTS, use_tqdm=False)
    encoded = engine.encode(TEXTS, use_tqdm=False)
    assert [o.prompt_token_ids for o in encoded] == [o.prompt_token_ids for o in embedded]
    for mine, theirs in zip(encoded, embedded):
        assert isinstance(mine.outputs.data, np.ndarray) and mine.outputs.data.dtype == np.float32
        np.testing.assert_array_equal(mine.outputs.data, np.asarray(theirs.outputs.embedding, np.float32))
        assert mine.finished and mine.prompt == theirs.prompt


def test_pooling_params_carry_truncation_as_the_keyword_does(engine):
    (by_keyword,) = engine.embed(TEXTS[1], truncate_prompt_tokens=5, use_tqdm=False)
    (by_params,) = engine.encode(TEXTS[1], PoolingParams(truncate_prompt_tokens=5), use_tqdm=False)
    (embed_params,) = engine.embed(TEXTS[1], pooling_params=PoolingParams(truncate_prompt_tokens=5), use_tqdm=False)
    assert by_params.prompt_token_ids == by_keyword.prompt_token_ids == embed_params.prompt_token_ids
    np.testing.assert_array_equal(by_params.outputs.data, np.asarray(by_keyword.outputs.embedding, np.float32))


def test_normalize_false_gives_the_pooled_vectors_as_they_are(engine):
    """all-MiniLM-L6-v2 mean-pools then normalizes; normalize=False stops before the normalization."""
    unit = np.asarray([o.outputs.embedding for o in engine.embed(TEXTS, use_tqdm=False)])
    raw = np.stack([o.outputs.data for o in engine.encode(TEXTS, PoolingParams(normalize=False), use_tqdm=False)])
    norms = np.linalg.norm(raw, axis=1)
    assert np.all(np.abs(norms - 1.0) > 0.1)
    np.testing.assert_allclose(raw / norms[:, None], unit, atol=1e-6, rtol=0)
    (asked,) = engine.embed(TEXTS[0], pooling_params=PoolingParams(normalize=True), use_tqdm=False)
    np.testing.assert_allclose(asked.outputs.embedding, unit[0], atol=1e-6, rtol=0)


def test_unsupported_tasks_and_options_are_value_errors(engine, default_engine):
    with pytest.raises(ValueError, match="pooling_task 'classify'"):
        engine.encode(TEXTS, pooling_task="classify", use_tqdm=False)
    with pytest.raises(ValueError, match="normalize must be True, False or None"):
        PoolingParams(normalize="no")
    with pytest.raises(ValueError, match="pooling_params must be a PoolingParams"):
        engine.encode(TEXTS, {"dimensions": 8}, use_tqdm=False)
    with pytest.raises(ValueError, match="generative model"):
        default_engine.encode(TEXTS, use_tqdm=False)
