"""AsyncEngine's pooled requests: embed and score calls, run on a worker thread of their own beside generation."""
from __future__ import annotations

import threading

from jvllm.engine.llm import Engine, PromptType
from jvllm.outputs import EmbeddingRequestOutput, ScoringRequestOutput
from jvllm.pooling.async_batcher import EmbeddingBatcher
from jvllm.pooling.embedder import embed_unsupported
from jvllm.pooling.scoring import ScoreJob, ScoreTexts


class AsyncPooling:
    """The embed/score half of AsyncEngine, which sets `engine`, calls `_init_pooling` and, on close,
    `_take_batcher` (the pooled path keeps no KV pages, so it never waits for the generation steps)."""

    engine: Engine

    def _init_pooling(self) -> None:
        self._embedder_lock = threading.Lock()
        self._embedder: EmbeddingBatcher | None = None  # started on the first embed() or score()

    def _check_alive(self) -> None:
        raise NotImplementedError

    async def embed(self, prompts: PromptType | list[PromptType], *, truncate: bool = True,
                    truncate_prompt_tokens: int | None = None, dimensions: int | None = None,
                    normalize: bool | None = None) -> list[EmbeddingRequestOutput]:
        """`Engine.embed` for asyncio callers: concurrent calls share padded forwards on a worker thread."""
        self._check_alive()
        if self.engine.embedder is None:
            raise embed_unsupported(self.engine.model.served_name)
        return await self._batcher().embed(prompts, truncate=truncate, truncate_prompt_tokens=truncate_prompt_tokens,
                                           dimensions=dimensions, normalize=normalize)

    async def score(self, text_1: ScoreTexts, text_2: ScoreTexts, *, truncate: bool = True,
                    truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """`Engine.score` for asyncio callers: pairs are tokenized and run on the same worker thread, in forwards
        shared with concurrent embed and score calls."""
        self._check_alive()
        job = ScoreJob(self.engine.embedder, self.engine.model.served_name, text_1, text_2, truncate=truncate,
                       truncate_prompt_tokens=truncate_prompt_tokens)
        return await self._batcher().score(job)

    def _batcher(self) -> EmbeddingBatcher:
        with self._embedder_lock:
            if self._embedder is None:
                self._embedder = EmbeddingBatcher(self.engine.embedder)
            return self._embedder

    def _take_batcher(self) -> EmbeddingBatcher | None:
        """The worker, if one started, taken out so no new call reaches it (the caller closes it)."""
        with self._embedder_lock:
            batcher, self._embedder = self._embedder, None
        return batcher

    @property
    def supports_embeddings(self) -> bool:
        return self.engine.embedder is not None and not self.engine.embedder.is_cross_encoder

    @property
    def supports_scoring(self) -> bool:
        """Text-pair scores: a cross-encoder's, or an embedding model's cosine similarities."""
        return self.engine.embedder is not None

    @property
    def is_cross_encoder(self) -> bool:
        return self.engine.model.is_cross_encoder

    @property
    def supports_dimensions(self) -> bool:
        return self.engine.supports_dimensions
