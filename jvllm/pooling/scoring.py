"""Text-pair scores (vLLM's LLM.score): a cross-encoder's classifier score, or the cosine similarity of the two
texts' embeddings. A ScoreJob splits one request into tokenizing and finishing, so the async batcher can run it in
rounds shared with other requests; `score` runs one offline."""
from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import numpy as np

from jvllm.outputs import ScoringOutput, ScoringRequestOutput
from jvllm.pooling.embedder import Embedder, progress_bar
from jvllm.pooling.token_inputs import tokenize_pairs


ScoreTexts = str | Sequence[str]
_request_ids = itertools.count()


def score_unsupported(served_name: str) -> ValueError:
    return ValueError(f"{served_name} is a generative model: it cannot score text pairs; serve a cross-encoder (a "
                      "*ForSequenceClassification checkpoint) or an embedding model, or give a generative model a "
                      "pooling (Engine(..., pooling='last')) to score with its embeddings")


def score_texts(text_1: Any, text_2: Any) -> tuple[list[str], list[str]]:
    """vLLM's pairing: text_1 and text_2 are each a string or a list of strings, paired 1:1, 1:N (the one text_1
    against every text_2) or N:N (element-wise). -> (text_1 list, text_2 list); ValueError otherwise."""
    firsts, seconds = _text_list(text_1, "text_1"), _text_list(text_2, "text_2")
    if not firsts or not seconds:
        raise ValueError(f"{'text_1' if not firsts else 'text_2'} must hold at least one text")
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise ValueError(f"text_1 has {len(firsts)} texts and text_2 has {len(seconds)}: pairs are 1:1, 1:N or N:N "
                         "(text_1 one text, or as many as text_2)")
    return firsts, seconds


def _text_list(value: Any, name: str) -> list[str]:
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if items is None or not all(isinstance(text, str) for text in items):
        raise ValueError(f"{name} must be a string or a list of strings")
    return items


def score_activation(config: Any) -> Callable[[np.ndarray], np.ndarray]:
    """A cross-encoder's logits [N, num_labels] -> scores, as vLLM's score pooler: the activation its config names
    (models.config.SCORE_ACTIVATIONS; Identity gives the raw logits, Sigmoid or Softmax vLLM's classify activation),
    else that classify activation: sigmoid for one label, softmax over several."""
    name = config.score_activation
    if name == "Identity":
        return lambda logits: logits
    if name == "Tanh":
        return np.tanh
    return _sigmoid if config.num_labels < 2 else _softmax


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Rows of a and b [N, D] -> [N] float64, as torch's CosineSimilarity (eps 1e-8) that vLLM scores with."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return np.sum(a * b, axis=1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-8)


class ScoreJob:
    """One score request: its pairs are checked when it is made, prepare() tokenizes them (on the caller's or the
    batcher's thread) and finish() turns the forwards' rows into ScoringRequestOutputs, in pair order."""

    def __init__(self, embedder: Embedder | None, served_name: str, text_1: ScoreTexts, text_2: ScoreTexts, *,
                 truncate: bool = True, truncate_prompt_tokens: int | None = None):
        if embedder is None:
            raise score_unsupported(served_name)
        self.embedder, self.served_name = embedder, served_name
        self.firsts, self.seconds = score_texts(text_1, text_2)
        self.truncate, self.truncate_prompt_tokens = truncate, truncate_prompt_tokens
        self._activation: Callable[[np.ndarray], np.ndarray] | None = None
        if embedder.is_cross_encoder:
            if embedder.output_size != 1:
                raise ValueError(f"{served_name} is a classifier with {embedder.output_size} labels; scores come from "
                                 "cross-encoders with one label (num_labels=1), as in vLLM")
            self._activation = score_activation(embedder.loaded.config)
        self._token_ids: list[list[int]] = []

    @property
    def num_pairs(self) -> int:
        return len(self.seconds)

    def prepare(self) -> tuple[list[list[int]], list[list[int]] | None]:
        """-> the token ids of every forward input and their token types (None: all 0); ValueError when refused
        (a pair over the token limit with truncate=False, a bad truncate_prompt_tokens)."""
        embedder = self.embedder
        if self._activation is not None:  # a cross-encoder: one input per pair
            firsts = self.firsts * self.num_pairs if len(self.firsts) == 1 else self.firsts
            with embedder.lock:  # truncation reconfigures the tokenizer
                limit = embedder.truncation_limit(self.truncate_prompt_tokens)
                truncate = self.truncate or self.truncate_prompt_tokens is not None
                pairs = tokenize_pairs(embedder.tokenizer, firsts, self.seconds, limit, truncate=truncate,
                                       served_name=self.served_name)
            self._token_ids = [pair.token_ids for pair in pairs]
            return self._token_ids, [pair.token_types for pair in pairs]
        inputs = embedder.prepare([*self.firsts, *self.seconds], truncate=self.truncate,
                                  truncate_prompt_tokens=self.truncate_prompt_tokens)
        self._token_ids = [ids for _, ids in inputs]
        return self._token_ids, None

    def finish(self, vectors: np.ndarray) -> list[ScoringRequestOutput]:
        """vectors [inputs, D]: the forwards' rows for prepare()'s inputs, in order."""
        if self._activation is not None:
            scores = self._activation(vectors.astype(np.float64))[:, 0]
            token_lists = self._token_ids
        else:
            count = len(self.firsts)
            first_rows = np.repeat(vectors[:1], self.num_pairs, axis=0) if count == 1 else vectors[:count]
            scores = cosine_similarity(first_rows, vectors[count:])
            first_ids = self._token_ids[:count] * self.num_pairs if count == 1 else self._token_ids[:count]
            pad = self.embedder.tokenizer.pad_token_id
            token_lists = [a + ([] if pad is None else [pad]) + b for a, b in zip(first_ids, self._token_ids[count:])]
        return [ScoringRequestOutput(f"score-{next(_request_ids)}", ScoringOutput(float(score)), list(ids))
                for score, ids in zip(scores, token_lists)]


def score(embedder: Embedder | None, served_name: str, text_1: ScoreTexts, text_2: ScoreTexts, *,
          truncate: bool = True, truncate_prompt_tokens: int | None = None,
          use_tqdm: bool = True) -> list[ScoringRequestOutput]:
    """Score every pair offline (Engine.score): one forward per padded bucket, outputs in pair order."""
    job = ScoreJob(embedder, served_name, text_1, text_2, truncate=truncate,
                   truncate_prompt_tokens=truncate_prompt_tokens)
    with job.embedder.lock:
        token_ids, token_types = job.prepare()
        progress = progress_bar(len(token_ids), use_tqdm, "Scoring pairs")
        try:
            vectors = job.embedder.embed_token_lists(token_ids, progress, token_types)  # [inputs, D]
        finally:
            if progress is not None:
                progress.close()
    return job.finish(vectors)
