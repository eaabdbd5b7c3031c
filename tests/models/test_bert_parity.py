"""The NNX BERT-family encoder against transformers (PyTorch) on tiny random models: every layer's hidden
states on a padded batch, `bert.`-prefixed task-head checkpoints, RoBERTa positions, activations, errors."""
from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import models.bert
from models.bert import gelu_erf
from jvllm.model_loader.embedded_models import embedded_model_path, find_embedded_model
from jvllm.model_loader.loader import load_model

TINY = dict(vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, type_vocab_size=2)
LENGTHS = [9, 3, 1, 7]  # real tokens per row; the rest is right padding


@pytest.fixture(scope="module")
def tokenizer_files():
    """all-MiniLM-L6-v2's tokenizer files (the tiny models share its 30522-token vocabulary)."""
    folder = embedded_model_path(find_embedded_model("all-MiniLM-L6-v2"))
    return [f"{folder}/{name}" for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                                            "special_tokens_map.json")]


@pytest.fixture(scope="module")
def make_tiny(tmp_path_factory, tokenizer_files):
    """make(model_cls, config_cls, **overrides) -> (HF folder, the torch model) of a tiny random encoder."""
    def make(model_cls, config_cls=transformers.BertConfig, **overrides):
        torch.manual_seed(0)
        model = model_cls(config_cls(**{**TINY, **overrides})).eval()
        folder = tmp_path_factory.mktemp(model_cls.__name__)
        model.save_pretrained(folder)
        for file in tokenizer_files:
            shutil.copy(file, folder)
        return folder, model
    return make


@pytest.fixture(autouse=True, params=["native", "xla"])
def encoder_path(request, monkeypatch):
    """Every test on both paths: the native encoder attention (XLA CPU's default for float32) and XLA's."""
    if request.param == "xla":
        monkeypatch.setattr(models.bert, "_native", lambda *arrays: False)
    return request.param


def padded_batch(seed: int = 0, low: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(LENGTHS), max(LENGTHS)), np.int32)
    mask = np.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        ids[row, :n] = rng.integers(low, TINY["vocab_size"], n)
        mask[row, :n] = 1
    return ids, mask


def torch_hidden_states(model, ids: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                    output_hidden_states=True)
    return [h.numpy() for h in out.hidden_states]  # embeddings output, then each layer's


def jvllm_hidden_states(folder, ids: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
    loaded = load_model(str(folder), dtype="float32")
    model = nnx.merge(loaded.graphdef, loaded.state)
    x = model.embed(jnp.asarray(ids))
    states = [np.asarray(x)]
    for layer in model.layers:
        x = layer(x, jnp.asarray(mask))
        states.append(np.asarray(x))
    final = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
    np.testing.assert_array_equal(final, states[-1])  # __call__ is exactly embed + the layers
    return states


def assert_close_on_real_tokens(ours: list[np.ndarray], theirs: list[np.ndarray], mask: np.ndarray,
                                atol: float = 2e-5) -> None:
    assert len(ours) == len(theirs)
    real = mask.astype(bool)
    for depth, (a, b) in enumerate(zip(ours, theirs)):
        np.testing.assert_allclose(a[real], b[real], atol=atol, rtol=0, err_msg=f"hidden states after layer {depth}")


def test_every_layer_matches_transformers_bert_on_a_padded_batch(make_tiny):
    folder, model = make_tiny(transformers.BertModel)
    ids, mask = padded_batch()
    ours = jvllm_hidden_states(folder, ids, mask)
    assert_close_on_real_tokens(ours, torch_hidden_states(model, ids, mask), mask)


def test_padding_does_not_leak_into_real_tokens(make_tiny):
    folder, _ = make_tiny(transformers.BertModel)
    loaded = load_model(str(folder), dtype="float32")
    model = nnx.merge(loaded.graphdef, loaded.state)
    ids, mask = padded_batch(seed=1)
    row = 1  # 3 real tokens, padded to 9
    padded = np.asarray(model(jnp.asarray(ids[row:row + 1]), jnp.asarray(mask[row:row + 1])))[0, :LENGTHS[row]]
    alone = np.asarray(model(jnp.asarray(ids[row:row + 1, :LENGTHS[row]]), jnp.ones((1, LENGTHS[row]), jnp.int32)))[0]
    np.testing.assert_allclose(padded, alone, atol=1e-5, rtol=0)


def test_sequences_packed_in_one_row_match_each_run_alone(make_tiny):
    """Packed rows number their sequences 1, 2, ... in the mask and restart positions at 0 for each."""
    folder, model = make_tiny(transformers.BertModel)
    loaded = load_model(str(folder), dtype="float32")
    ours = nnx.merge(loaded.graphdef, loaded.state)
    rng = np.random.default_rng(5)
    first, second = rng.integers(5, 30000, 6), rng.integers(5, 30000, 4)
    ids = np.zeros((1, 12), np.int32)
    ids[0, :6], ids[0, 6:10] = first, second
    segments = np.array([[1] * 6 + [2] * 4 + [0] * 2], np.int32)
    positions = np.array([[*range(6), *range(4), 0, 0]], np.int32)
    packed = np.asarray(ours(jnp.asarray(ids), jnp.asarray(segments), jnp.asarray(positions)))[0]
    for tokens, span in ((first, slice(0, 6)), (second, slice(6, 10))):
        alone = torch_hidden_states(model, tokens[None], np.ones((1, len(tokens)), np.int32))[-1][0]
        np.testing.assert_allclose(packed[span], alone, atol=2e-5, rtol=0)


def test_masked_lm_checkpoint_with_bert_prefix_loads_the_same_encoder(make_tiny):
    folder, mlm = make_tiny(transformers.BertForMaskedLM)
    names = json.loads((folder / "config.json").read_text())["architectures"]
    assert names == ["BertForMaskedLM"]
    ids, mask = padded_batch(seed=2)
    ours = jvllm_hidden_states(folder, ids, mask)
    assert_close_on_real_tokens(ours, torch_hidden_states(mlm.bert, ids, mask), mask)


def test_roberta_positions_start_after_the_padding_index(make_tiny):
    folder, model = make_tiny(transformers.RobertaModel, transformers.RobertaConfig, pad_token_id=1,
                              max_position_embeddings=TINY["max_position_embeddings"] + 2, type_vocab_size=1)
    ids, mask = padded_batch(seed=3)
    ids = np.where(mask > 0, ids, 1)  # RoBERTa pads with id 1
    loaded = load_model(str(folder), dtype="float32")
    assert loaded.config.position_offset == 2 and loaded.config.max_tokens == TINY["max_position_embeddings"]
    assert_close_on_real_tokens(jvllm_hidden_states(folder, ids, mask), torch_hidden_states(model, ids, mask), mask)


@pytest.mark.parametrize("act", ["gelu_new", "relu"])
def test_other_hidden_activations_match(make_tiny, act):
    folder, model = make_tiny(transformers.BertModel, hidden_act=act)
    ids, mask = padded_batch(seed=4)
    assert_close_on_real_tokens(jvllm_hidden_states(folder, ids, mask)[-1:], torch_hidden_states(model, ids, mask)[-1:],
                                mask)


def test_dummy_weights_have_the_checkpoint_shapes(make_tiny):
    import jax

    folder, _ = make_tiny(transformers.BertModel)
    real, dummy = load_model(str(folder)), load_model(str(folder), load_format="dummy")
    assert real.is_encoder and dummy.is_encoder
    assert [x.shape for x in jax.tree.leaves(real.state)] == [x.shape for x in jax.tree.leaves(dummy.state)]


def test_relative_position_embeddings_are_rejected_clearly(make_tiny):
    folder, _ = make_tiny(transformers.BertModel)
    config = json.loads((folder / "config.json").read_text())
    config["position_embedding_type"] = "relative_key"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="position_embedding_type"):
        load_model(str(folder))


def test_minilm_weights_match_transformers_on_real_text():
    """The shipped all-MiniLM-L6-v2 (a BertModel checkpoint) layer by layer on tokenized sentences."""
    folder = embedded_model_path(find_embedded_model("all-MiniLM-L6-v2"))
    model = transformers.AutoModel.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(["A man is eating food.", "Ein Mann isst.", "x"], padding=True, return_tensors="np")
    ids, mask = batch["input_ids"].astype(np.int32), batch["attention_mask"].astype(np.int32)
    assert_close_on_real_tokens(jvllm_hidden_states(folder, ids, mask), torch_hidden_states(model, ids, mask), mask,
                                atol=5e-5)


def test_gelu_is_torchs_erf_form_and_keeps_the_dtype():
    """The erf form PyTorch computes: within 1e-6 of torch's GELU everywhere (the far negative tail
    included, where it and jax.nn.gelu's erfc form are all below 1e-6), and bfloat16 stays bfloat16."""
    x = np.linspace(-12, 12, 4001, dtype=np.float32)
    theirs = torch.nn.functional.gelu(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.asarray(gelu_erf(jnp.asarray(x))), theirs, rtol=2e-6, atol=1e-6)
    assert gelu_erf(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16
