"""The Engine's pooling calls, as vLLM's LLM has them: embed, encode (embed with NumPy vectors) and score."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jvllm.engine.prompts import PromptType
from jvllm.outputs import EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput, ScoringRequestOutput
from jvllm.pooling.embedder import embed_unsupported
from jvllm.pooling.scoring import ScoreTexts, score
from jvllm.pooling_params import PoolingParams, embed_options


class PoolingCalls:
    """Mixed into Engine: needs its `embedder` (None for a generative model) and `model`."""

    embedder: Any
    model: Any

    def embed(self, prompts: PromptType | Sequence[PromptType], *, truncate: bool = True,
              truncate_prompt_tokens: int | None = None, dimensions: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (str, {'prompt': str} or {'prompt_token_ids': [...]}); outputs in input order.

        Too-long prompts keep their first max_model_len tokens (special tokens kept, as sentence-transformers
        truncates), or raise ValueError with truncate=False. truncate_prompt_tokens=k keeps the last k tokens
        (vLLM's meaning; -1 = max_model_len). dimensions= shortens Matryoshka models' outputs only; both may come
        in pooling_params instead, as vLLM's, with `normalize` (False: the pooled vectors as they are; None: as
        the model's pooling config says)."""
        if self.embedder is None:
            raise embed_unsupported(self.model.served_name)
        normalize = None
        if pooling_params is not None:
            options = embed_options(pooling_params, truncate_prompt_tokens, None)
            truncate_prompt_tokens, dimensions = options["truncate_prompt_tokens"], dimensions or options["dimensions"]
            normalize = options["normalize"]
        return self.embedder.embed(prompts, truncate=truncate, truncate_prompt_tokens=truncate_prompt_tokens,
                                   dimensions=dimensions, normalize=normalize, use_tqdm=use_tqdm)

    def encode(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               pooling_task: str | None = "embed") -> list[PoolingRequestOutput]:
        """vLLM's LLM.encode on an embedding model: embed() with each vector as a NumPy array (outputs.data)."""
        embed_options(pooling_params, truncate_prompt_tokens, pooling_task)  # refuses other tasks and bad params
        outputs = self.embed(prompts, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                             pooling_params=pooling_params)
        return [PoolingRequestOutput(out.request_id, PoolingOutput(np.asarray(out.outputs.embedding, np.float32)),
                                     out.prompt_token_ids, out.finished, out.prompt) for out in outputs]

    def score(self, text_1: ScoreTexts, text_2: ScoreTexts, *, truncate: bool = True,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: pairs 1:1, 1:N or N:N (jvllm.pooling.scoring); a cross-encoder's score, else the cosine
        similarity of the texts' embeddings. truncate / truncate_prompt_tokens as embed() (a pair: longest first)."""
        return score(self.embedder, self.model.served_name, text_1, text_2, truncate=truncate,
                     truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)
