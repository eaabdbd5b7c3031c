"""EmbeddingBatcher: one worker thread merges concurrent async embedding requests into shared forwards."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from typing import Any, Sequence

import numpy as np

from jvllm.pooling.embedder import Embedder, PromptType
from jvllm.outputs import EmbeddingRequestOutput

logger = logging.getLogger("jvllm.engine.async_engine")


class EmbedderClosedError(RuntimeError):
    """The batcher was shut down; no embedding can be served any more."""


@dataclasses.dataclass
class _Job:
    prompts: list[PromptType]
    truncate: bool
    truncate_prompt_tokens: int | None
    dimensions: int | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class EmbeddingBatcher:
    """`await batcher.embed(prompts)` from any event loop. Requests that arrive while a round runs are
    tokenized and embedded together in the next round, so many small HTTP requests fill the same padded
    buckets that one big `Engine.embed` call would."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder
        self._jobs: list[_Job] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="jvllm-embed", daemon=True)
        self._thread.start()

    async def embed(self, prompts: PromptType | Sequence[PromptType], *, truncate: bool = True,
                    truncate_prompt_tokens: int | None = None,
                    dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
        """Embed like `Engine.embed` (outputs in input order); ValueError for a refused request."""
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        loop = asyncio.get_running_loop()
        job = _Job(prompt_list, truncate, truncate_prompt_tokens, dimensions, loop, loop.create_future())
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
        """Tokenize every job (a refused one fails alone), embed all their inputs in one call, split them up."""
        prepared: list[tuple[_Job, list[tuple[str | None, list[int]]]]] = []
        for job in jobs:
            try:
                inputs = self.embedder.prepare(job.prompts, truncate=job.truncate,
                                               truncate_prompt_tokens=job.truncate_prompt_tokens,
                                               dimensions=job.dimensions)
            except Exception as error:
                _settle(job, error=error)
                continue
            prepared.append((job, inputs))
        if not prepared:
            return
        token_lists = [ids for _, inputs in prepared for _, ids in inputs]
        try:
            vectors = self.embedder.embed_token_lists(token_lists)  # [sum of inputs, D]
        except Exception as error:
            logger.error("an embedding round failed", exc_info=error)
            for job, _ in prepared:
                _settle(job, error=error)
            return
        start = 0
        for job, inputs in prepared:
            mine: np.ndarray = vectors[start: start + len(inputs)]
            start += len(inputs)
            try:
                _settle(job, result=self.embedder.outputs(inputs, mine, job.dimensions))
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
