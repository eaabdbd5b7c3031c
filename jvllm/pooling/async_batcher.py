"""EmbeddingBatcher: one worker thread merges concurrent async embedding (and pair-scoring) requests into shared
forwards."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from typing import Any, Protocol, Sequence

import numpy as np

from jvllm.pooling.embedder import Embedder, PromptType
from jvllm.outputs import EmbeddingRequestOutput, ScoringRequestOutput
from jvllm.pooling.scoring import ScoreJob

logger = logging.getLogger("jvllm.engine.async_engine")


class EmbedderClosedError(RuntimeError):
    """The batcher was shut down; no embedding can be served any more."""


class PooledWork(Protocol):
    """One request the worker runs: prepare() -> the token ids of its forward inputs and their token types (None:
    all 0), on the worker thread (ValueError when refused); finish(rows [inputs, D]) -> its result."""

    def prepare(self) -> tuple[list[list[int]], list[list[int]] | None]: ...

    def finish(self, vectors: np.ndarray) -> Any: ...


@dataclasses.dataclass
class _EmbedWork:
    embedder: Embedder
    prompts: list[PromptType]
    truncate: bool
    truncate_prompt_tokens: int | None
    dimensions: int | None
    normalize: bool | None = None
    inputs: list[tuple[str | None, list[int]]] = dataclasses.field(default_factory=list)

    def prepare(self) -> tuple[list[list[int]], None]:
        self.inputs = self.embedder.prepare(self.prompts, truncate=self.truncate,
                                            truncate_prompt_tokens=self.truncate_prompt_tokens,
                                            dimensions=self.dimensions)
        return [ids for _, ids in self.inputs], None

    def finish(self, vectors: np.ndarray) -> list[EmbeddingRequestOutput]:
        return self.embedder.outputs(self.inputs, vectors, self.dimensions, self.normalize)


@dataclasses.dataclass
class _Job:
    work: PooledWork
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class EmbeddingBatcher:
    """`await batcher.embed(prompts)` (or `score(job)`) from any event loop. Requests that arrive while a round runs
    are tokenized and run together in the next round, so many small HTTP requests fill the same padded buckets that
    one big `Engine.embed` call would."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder
        self._jobs: list[_Job] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="jvllm-embed", daemon=True)
        self._thread.start()

    async def embed(self, prompts: PromptType | Sequence[PromptType], *, truncate: bool = True,
                    truncate_prompt_tokens: int | None = None, dimensions: int | None = None,
                    normalize: bool | None = None) -> list[EmbeddingRequestOutput]:
        """Embed like `Engine.embed` (outputs in input order); ValueError for a refused request."""
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        return await self.run(_EmbedWork(self.embedder, prompt_list, truncate, truncate_prompt_tokens, dimensions,
                                         normalize))

    async def score(self, job: ScoreJob) -> list[ScoringRequestOutput]:
        """Score like `Engine.score` (outputs in pair order); ValueError for a refused request."""
        return await self.run(job)

    async def run(self, work: PooledWork) -> Any:
        """Run one request in the next round; its finish() result, or the error that refused it."""
        loop = asyncio.get_running_loop()
        job = _Job(work, loop, loop.create_future())
        with self._cv:
            if self._closed:
                raise EmbedderClosedError("the embedding worker is shut down")
            self._jobs.append(job)
            self._cv.notify()
        return await job.future

    def close(self) -> None:
        """Stop the worker; requests still queued fail with EmbedderClosedError."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()

    # ---- the worker thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                jobs, self._jobs = self._jobs, []
                closed = self._closed
            if closed:
                for job in jobs:
                    _settle(job, error=EmbedderClosedError("the embedding worker is shut down"))
                return
            self._round([job for job in jobs if not job.future.cancelled()])

    def _round(self, jobs: list[_Job]) -> None:
        """Tokenize every job (a refused one fails alone), run all their inputs in one call, split them up."""
        prepared: list[tuple[_Job, list[list[int]], list[list[int]] | None]] = []
        for job in jobs:
            try:
                token_lists, token_types = job.work.prepare()
            except Exception as error:
                _settle(job, error=error)
                continue
            prepared.append((job, token_lists, token_types))
        if not prepared:
            return
        token_lists = [ids for _, lists, _ in prepared for ids in lists]
        token_types = None
        if any(types is not None for _, _, types in prepared):
            token_types = [t for _, lists, types in prepared
                           for t in (types if types is not None else [[0] * len(ids) for ids in lists])]
        try:
            vectors = self.embedder.embed_token_lists(token_lists, token_types=token_types)  # [sum of inputs, D]
        except Exception as error:
            logger.error("an embedding round failed", exc_info=error)
            for job, _, _ in prepared:
                _settle(job, error=error)
            return
        start = 0
        for job, lists, _ in prepared:
            mine: np.ndarray = vectors[start: start + len(lists)]
            start += len(lists)
            try:
                _settle(job, result=job.work.finish(mine))
            except Exception as error:
                _settle(job, error=error)


def _settle(job: _Job, *, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve the job's future on its own loop (a cancelled future or a closed loop is left alone)."""
    def resolve() -> None:
        if job.future.done():
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    try:
        job.loop.call_soon_threadsafe(resolve)
    except RuntimeError:  # the caller's loop is closed: nobody is waiting
        pass
