"""The pooled path of an Engine: prompts -> token ids (truncated as sentence-transformers does) -> bucketed
forwards (one per batch, no KV pages kept) -> EmbeddingRequestOutputs in input order (a cross-encoder's forwards
give its classifier's logits: jvllm.pooling.scoring)."""
from __future__ import annotations

import itertools
import logging
import threading
from typing import Any, Sequence

import jax
import numpy as np

from jvllm.config import EngineConfig
from jvllm.utils import next_power_of_2
from jvllm.pooling.batching import EmbedBatch, batch_shapes, pack_arrays, plan_batches
from jvllm.worker.compile_watch import compile_watch
from jvllm.worker.executable_memo import compile_once
from jvllm.pooling.forward import build_causal_forward, build_classifier_forward, build_encoder_forward
from jvllm.pooling.token_inputs import InputTooLongError, truncate_tokens
from jvllm.worker.weights import cast_matrices
from jvllm.outputs import EmbeddingOutput, EmbeddingRequestOutput
from jvllm.model_loader.loader import LoadedModel
from models.pooling import PoolingConfig, read_sentence_transformers_config, resolve_pooling

logger = logging.getLogger("jvllm")
PromptType = str | dict[str, Any]

# An encoder step is cheap, so its batches are wider than generation's (chosen with benchmarks/embed.py:
# benchmarks/results/embed_cpu.md)
_ENCODER_MAX_NUM_SEQS = 256
_ENCODER_MAX_NUM_BATCHED_TOKENS = 1024
_BATCHED_MIN_TOKENS = 512  # batches of at least this many padded tokens use the batched (e.g. bf16) weights


def generate_unsupported(served_name: str, cross_encoder: bool = False) -> ValueError:
    if cross_encoder:
        return ValueError(f"{served_name} is a cross-encoder: it cannot generate text; use Engine.score() "
                          "(or /v1/score, /v1/rerank)")
    return ValueError(f"{served_name} is an embedding model: it cannot generate text; use Engine.embed() "
                      "(or /v1/embeddings)")


def embed_unsupported(served_name: str) -> ValueError:
    return ValueError(f"{served_name} is a generative model; to embed with it, choose a pooling: "
                      "Engine(..., pooling='last') (last-token pooling, as vLLM does for causal LMs)")


def model_token_limit(loaded: LoadedModel) -> int:
    """The longest input an encoder takes: sentence-transformers' max_seq_length, else the position table."""
    st = read_sentence_transformers_config(loaded.folder) if loaded.folder and not loaded.is_cross_encoder else None
    table = loaded.config.max_tokens
    return min(st.max_seq_length, table) if st is not None and st.max_seq_length else table


def encoder_engine_config(loaded: LoadedModel, *, max_model_len: int | None, max_num_seqs: int | None,
                          max_num_batched_tokens: int | None, block_size: int) -> EngineConfig:
    """Limits of an encoder engine: no KV pool (two placeholder pages keep the page manager valid)."""
    table = loaded.config.max_tokens
    if max_model_len is not None and max_model_len > table:
        raise ValueError(f"max_model_len {max_model_len} exceeds the {table} positions of {loaded.served_name}")
    max_model_len = max_model_len or model_token_limit(loaded)
    max_num_batched_tokens = max_num_batched_tokens or max(_ENCODER_MAX_NUM_BATCHED_TOKENS, max_model_len)
    if max_num_batched_tokens < max_model_len:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_model_len "
                         f"({max_model_len}): an embedding input is never split across forwards")
    return EngineConfig(max_model_len, max_num_seqs or _ENCODER_MAX_NUM_SEQS, max_num_batched_tokens, block_size, 2)


def build_embedder(loaded: LoadedModel, config: EngineConfig, *, pooling: str | None, normalize: bool | None,
                   batched_weight_dtype: Any = None) -> "Embedder | None":
    """The engine's embedder, or None for a causal LM given no pooling choice (it then only generates). A
    cross-encoder's runs its classifier head instead of a pooling."""
    if loaded.is_cross_encoder:
        if pooling is not None or normalize is not None:
            raise ValueError(f"{loaded.served_name} is a cross-encoder: it scores pairs with its classifier head, "
                             "so pooling= and normalize= do not apply")
        return Embedder(loaded, PoolingConfig("cls", False), config, batched_weight_dtype=batched_weight_dtype)
    st = read_sentence_transformers_config(loaded.folder) if loaded.folder is not None else None
    choice = resolve_pooling(st, is_encoder=loaded.is_encoder, pooling=pooling, normalize=normalize)
    if choice is None:
        return None
    return Embedder(loaded, choice, config, batched_weight_dtype=batched_weight_dtype)


class Embedder:
    """Embeds prompts with one jitted forward per padded [rows, width] bucket; thread-safe."""

    def __init__(self, loaded: LoadedModel, pooling: PoolingConfig, config: EngineConfig, *,
                 batched_weight_dtype: Any = None):
        self.loaded, self.pooling, self.config = loaded, pooling, config
        self.tokenizer = loaded.tokenizer
        self.weights, treedef = jax.tree.flatten(loaded.state)
        self.batched_weights = None if batched_weight_dtype is None else cast_matrices(self.weights,
                                                                                      batched_weight_dtype)
        cfg = loaded.config
        self.num_slots = next_power_of_2(config.max_num_seqs)  # outputs per forward: a static shape
        self.is_cross_encoder = loaded.is_cross_encoder
        self.output_size = cfg.num_labels if self.is_cross_encoder else cfg.hidden_size  # D of each forward's rows
        if self.is_cross_encoder:
            self.forward = build_classifier_forward(loaded.graphdef, treedef, self.num_slots)
        elif loaded.is_encoder:
            self.forward = build_encoder_forward(loaded.graphdef, treedef, pooling, self.num_slots)
        else:
            self.forward = build_causal_forward(loaded.graphdef, treedef, pooling, self.num_slots, cfg.num_layers,
                                                cfg.num_kv_heads, cfg.head_dim, loaded.dtype)
        self.hidden_size = cfg.hidden_size
        self.matryoshka_dimensions = getattr(cfg, "matryoshka_dimensions", None)
        tok = self.tokenizer
        self._structural_ids = {t for t in (tok.cls_token_id, tok.sep_token_id, tok.bos_token_id, tok.eos_token_id)
                                if t is not None}
        self._pad_id = self.tokenizer.pad_token_id or 0
        self._counter = itertools.count()
        self.lock = threading.RLock()  # the tokenizer and the device steps are used by one caller at a time
        self._compiled: dict[tuple[int, int], Any] = {}  # (rows, width) -> the forward compiled for that batch
        if not self.is_cross_encoder:
            logger.info("embedding with %s pooling%s, up to %d tokens per input", pooling.mode,
                        " + L2 normalization" if pooling.normalize else "", config.max_model_len)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def supports_dimensions(self) -> bool:
        """Whether outputs may be shortened (`dimensions=`): only for Matryoshka-trained models."""
        return bool(self.matryoshka_dimensions)

    # ---- inputs -------------------------------------------------------------------------------
    def tokenize(self, prompts: Sequence[PromptType], *, truncate: bool = True,
                 truncate_prompt_tokens: int | None = None) -> list[tuple[str | None, list[int]]]:
        """-> (text, token ids the model will see) per prompt; ValueError for bad or (untruncated) long ones."""
        keep_last = truncate_prompt_tokens is not None
        limit = self.truncation_limit(truncate_prompt_tokens)
        texts, token_lists, special_masks = self._token_ids(prompts)
        out = []
        for index, (text, ids, special) in enumerate(zip(texts, token_lists, special_masks)):
            if not ids:
                raise ValueError(f"prompt {index} is empty: it must contain at least one token")
            if len(ids) > limit:
                if not truncate and not keep_last:
                    raise InputTooLongError(
                        f"prompt {index} has {len(ids)} tokens but {self.loaded.served_name} takes at most {limit}; "
                        "shorten it or pass truncate=True to keep the first tokens (as sentence-transformers does)",
                        index=index, num_tokens=len(ids), limit=limit)
                ids = truncate_tokens(ids, special, limit, keep_last=keep_last)
            out.append((text, ids))
        return out

    def truncation_limit(self, truncate_prompt_tokens: int | None) -> int:
        """vLLM's truncate_prompt_tokens -> a token limit: -1 is the model's, k is k (a text keeps its last k tokens,
        a cross-encoder's pair is cut longest-first)."""
        if truncate_prompt_tokens is None or truncate_prompt_tokens == -1:
            return self.max_model_len
        if not isinstance(truncate_prompt_tokens, int) or not 1 <= truncate_prompt_tokens <= self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens must be -1 or in [1, {self.max_model_len}] (max_model_len), "
                             f"got {truncate_prompt_tokens!r}")
        return truncate_prompt_tokens

    def _token_ids(self, prompts: Sequence[PromptType]) -> tuple[list[str | None], list[list[int]], list[list[bool]]]:
        """-> texts, token ids, and which ids are structural special tokens ([CLS], [SEP], BOS, EOS) that
        truncation keeps. For text the tokenizer says which tokens it added; an [UNK] in the text is content."""
        texts: list[str | None] = []
        token_lists: list[list[int] | None] = []
        special_masks: list[list[bool] | None] = []
        for prompt in prompts:
            if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                vocab = self.loaded.config.vocab_size
                if not isinstance(ids, (list, tuple)) or any(
                        isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab for t in ids):
                    raise ValueError(f"prompt token ids must be a list of integers in [0, {vocab})")
                texts.append(prompt.get("prompt"))
                token_lists.append([int(t) for t in ids])
                special_masks.append([int(t) in self._structural_ids for t in ids])
            elif isinstance(prompt, str) or (isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str)):
                texts.append(prompt if isinstance(prompt, str) else prompt["prompt"])
                token_lists.append(None)
                special_masks.append(None)
            else:
                raise ValueError("a prompt is a str, {'prompt': str} or {'prompt_token_ids': [int, ...]}; "
                                 f"got {type(prompt).__name__}")
        pending = [i for i, ids in enumerate(token_lists) if ids is None]
        if pending:  # one batched call: the fast tokenizer encodes in parallel
            encoded = self.tokenizer([texts[i] for i in pending], return_special_tokens_mask=True, verbose=False)
            for i, ids, special in zip(pending, encoded["input_ids"], encoded["special_tokens_mask"]):
                token_lists[i], special_masks[i] = list(ids), [bool(s) for s in special]
        return texts, token_lists, special_masks  # type: ignore[return-value]

    # ---- device -------------------------------------------------------------------------------
    def embed_token_lists(self, token_lists: Sequence[Sequence[int]], progress: Any = None,
                          token_types: Sequence[Sequence[int]] | None = None) -> np.ndarray:
        """-> [N, output_size] float32 embeddings (a cross-encoder's logits) in input order; `token_types` per token
        (default 0). Every batch is dispatched before any result is read, so the host pads batch i + 1 while the
        device runs batch i."""
        cfg = self.config
        batches = plan_batches([len(t) for t in token_lists], max_num_seqs=cfg.max_num_seqs,
                               max_num_batched_tokens=cfg.max_num_batched_tokens, share_rows=self.loaded.is_encoder)
        out = np.zeros((len(token_lists), self.output_size), np.float32)
        with self.lock:
            pending = [(batch, self._run(token_lists, token_types, batch)) for batch in batches]
            for batch, result in pending:
                out[list(batch.indices)] = np.asarray(result)[: len(batch.indices)]
                if progress is not None:
                    progress.update(len(batch.indices))
        return out

    def _run(self, token_lists: Sequence[Sequence[int]], token_types: Sequence[Sequence[int]] | None,
             batch: EmbedBatch) -> jax.Array:
        arrays = pack_arrays(token_lists, batch, self._pad_id, token_types)  # ids, positions, segments, types
        shape = (batch.rows, batch.width)
        forward = self._compiled.get(shape)
        if forward is None:
            logger.info("compiling embedding batch shape rows=%d width=%d", *shape)
            forward = self._compiled[shape] = self._compile(shape)
        with compile_watch().running(f"embedding rows={shape[0]} width={shape[1]}"):
            return forward(self._weights_for(shape), *arrays)

    def _weights_for(self, shape: tuple[int, int]) -> list[jax.Array]:
        big = self.batched_weights is not None and shape[0] * shape[1] >= _BATCHED_MIN_TOKENS
        return self.batched_weights if big else self.weights

    def _compile(self, shape: tuple[int, int]) -> Any:
        spec = jax.ShapeDtypeStruct(shape, np.int32)
        return compile_once(self.forward.lower(self._weights_for(shape), spec, spec, spec, spec))

    def batch_shapes(self) -> list[tuple[int, int]]:
        """Every (rows, width) batch this embedder can run."""
        cfg = self.config
        return batch_shapes(cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
                            max_num_batched_tokens=cfg.max_num_batched_tokens, share_rows=self.loaded.is_encoder)

    def precompile(self, progress: Any = None) -> None:
        """Compile the forward of every batch shape (or load it from the persistent cache)."""
        with compile_watch().expected():
            for shape in self.batch_shapes():
                if shape not in self._compiled:
                    self._compiled[shape] = self._compile(shape)
                if progress is not None:
                    progress.update(1)

    @property
    def compiled_shapes(self) -> set[tuple[int, int]]:
        return set(self._compiled)

    # ---- API ----------------------------------------------------------------------------------
    def embed(self, prompts: PromptType | Sequence[PromptType], *, truncate: bool = True,
              truncate_prompt_tokens: int | None = None, dimensions: int | None = None,
              normalize: bool | None = None, use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        with self.lock:
            inputs = self.prepare(prompt_list, truncate=truncate, truncate_prompt_tokens=truncate_prompt_tokens,
                                  dimensions=dimensions)
            progress = progress_bar(len(inputs), use_tqdm)
            try:
                vectors = self.embed_token_lists([ids for _, ids in inputs], progress)
            finally:
                if progress is not None:
                    progress.close()
        return self.outputs(inputs, vectors, dimensions, normalize)

    def prepare(self, prompts: Sequence[PromptType], *, truncate: bool = True,
                truncate_prompt_tokens: int | None = None,
                dimensions: int | None = None) -> list[tuple[str | None, list[int]]]:
        """Validate a request and tokenize it: -> (text, token ids) per prompt; ValueError when refused."""
        if self.is_cross_encoder:
            raise ValueError(f"{self.loaded.served_name} is a cross-encoder: it scores text pairs and does not embed; "
                             "use Engine.score() (or /v1/score, /v1/rerank)")
        if not prompts:
            raise ValueError("embed() needs at least one prompt")
        self._check_dimensions(dimensions)
        with self.lock:
            return self.tokenize(prompts, truncate=truncate, truncate_prompt_tokens=truncate_prompt_tokens)

    def outputs(self, inputs: Sequence[tuple[str | None, list[int]]], vectors: np.ndarray,
                dimensions: int | None = None, normalize: bool | None = None) -> list[EmbeddingRequestOutput]:
        """Pooled vectors [N, D] of the prepared inputs -> outputs, shortened to `dimensions`, then scaled to unit
        length when `normalize` says so (None: as the model's pooling config does)."""
        if dimensions is not None:
            vectors = vectors[:, :dimensions]
        if self.pooling.normalize if normalize is None else normalize:
            vectors = unit_length(vectors)
        return [EmbeddingRequestOutput(f"embd-{next(self._counter)}", EmbeddingOutput(vector.tolist()), ids,
                                       True, text) for (text, ids), vector in zip(inputs, vectors)]

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        if not self.supports_dimensions:
            raise ValueError(f"{self.loaded.served_name} does not support Matryoshka representations: its "
                             "embeddings cannot be shortened with dimensions=")
        if not isinstance(dimensions, int) or not 1 <= dimensions <= self.hidden_size:
            raise ValueError(f"dimensions must be in [1, {self.hidden_size}], got {dimensions!r}")


def unit_length(vectors: np.ndarray) -> np.ndarray:
    """[N, D] -> rows scaled to unit length (a zero row stays zero, as torch's F.normalize with eps 1e-12)."""
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def progress_bar(total: int, enabled: bool, desc: str = "Embedding prompts") -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="prompt", dynamic_ncols=True)
