"""AsyncEngine: one background thread drives Engine.step and feeds per-request async streams."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable

from jvllm.collector import young_collections_spaced
from jvllm.config import EngineConfig
from jvllm.engine.commands import Abort, Add, Command, CommandQueue
from jvllm.engine.arg_utils import EngineArgs
from jvllm.engine.llm import Engine, PromptType
from jvllm.engine.request_stream import RequestStream, aborted_output
from jvllm.engine.status import EngineDeadError, EngineShutDownError, EngineStats, EngineStepError, QueueFullError
from jvllm.multimodal.inputs import ProcessedImage
from jvllm.engine.async_pooling import AsyncPooling
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("jvllm.engine.async_engine")

# After this many step failures in a row (with no good step between) the engine counts as dead.
_MAX_CONSECUTIVE_STEP_FAILURES = 3

# An idle engine woken by a request waits for more while they keep coming (each within the gap), so that
# a burst of clients shares one prefill step instead of the first one running alone and holding the rest
# back by a whole step (hundreds of ms on CPU). The wait is capped at a fraction of the recent step time
# (and at max_burst_wait_s), so it stays small next to what it saves; a lone request waits one gap.
DEFAULT_BURST_GAP_S = 0.005
DEFAULT_MAX_BURST_WAIT_S = 0.05
BURST_WAIT_STEP_FRACTION = 0.25


OutputObserver = Callable[[RequestOutput], None]


class AsyncEngine(AsyncPooling):
    """Wraps an `Engine` for asyncio callers (the HTTP server, notebooks with top-level `await`).

    The Engine is not thread-safe, so exactly one thread ever touches it: the engine thread applies
    queued add/abort commands between steps, steps while requests exist and sleeps otherwise.
    Outputs travel back with `loop.call_soon_threadsafe`, one call per step and event loop."""

    def __init__(self, engine: Engine, *, max_waiting_requests: int | None = None,
                 observers: list[OutputObserver] | None = None, burst_gap_s: float = DEFAULT_BURST_GAP_S,
                 max_burst_wait_s: float = DEFAULT_MAX_BURST_WAIT_S) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1 or None, got {max_waiting_requests}")
        if burst_gap_s < 0 or max_burst_wait_s < 0:
            raise ValueError("burst_gap_s and max_burst_wait_s must be >= 0")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.burst_gap_s = burst_gap_s
        self.max_burst_wait_s = max_burst_wait_s
        self._step_seconds: float | None = None  # moving average of recent step times
        self.observers: list[OutputObserver] = list(observers or [])
        self.stats = EngineStats()
        self.dead_error: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}  # owned by the callers' event loops
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}  # owned by the engine thread
        self._commands = CommandQueue()
        engine.arrivals = self._commands.has_adds
        self._failures = 0
        self._init_pooling()
        self._thread = threading.Thread(target=self._run, name="jvllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs | None = None, *, max_waiting_requests: int | None = None,
                         **engine_kwargs: Any) -> AsyncEngine:
        """An AsyncEngine over a new Engine, built from `engine_args` or from Engine's keywords."""
        engine = Engine.from_engine_args(engine_args) if engine_args is not None else Engine(**engine_kwargs)
        return cls(engine, max_waiting_requests=max_waiting_requests)

    # ---- what the server reads ------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def eos_token_ids(self) -> list[int]:
        return self.engine.eos_token_ids

    @property
    def default_sampling(self) -> dict[str, Any]:
        """SamplingParams keywords from the model's generation config: the defaults of what a request leaves out."""
        return self.engine.default_sampling

    @property
    def config(self) -> EngineConfig:
        """The engine's limits (max_num_seqs, max_model_len, ...)."""
        return self.engine.config

    @property
    def image_token(self) -> str | None:
        return self.engine.image_token

    def load_images(self, urls: list[str]) -> list[ProcessedImage]:
        """Engine.load_images (blocking: run it off the event loop)."""
        return self.engine.load_images(urls)

    def expand_image_tokens(self, token_ids: list[int], images: list[ProcessedImage]) -> list[int]:
        return self.engine.expand_image_tokens(token_ids, images)

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and self._thread.is_alive()

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.engine.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def check_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Engine.check_structured_outputs, callable from any thread."""
        self.engine.check_structured_outputs(params)

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """The chat prompt as text (the tokenizer's template, or `chat_template=` if given)."""
        return self.engine.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)

    # ---- requests -------------------------------------------------------------------------------
    async def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                          request_id: str | None = None, *, arrival_time: float | None = None,
                          priority: int = 0) -> RequestStream:
        """Queue a request and return its output stream; a refused request raises here (ValueError for
        a bad prompt or params or a priority the scheduling policy does not take, QueueFullError when the
        waiting queue is at its limit)."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, prompt, loop, self._stream_closed)
        self._streams[request_id] = stream
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._submit(Add(request_id, prompt, params or SamplingParams(), arrival_time or time.time(), loop,
                              future, priority))
            await asyncio.wrap_future(future)
        except Exception:
            stream.done = True  # refused: nothing was queued
            stream.close()
            raise
        except BaseException:
            stream.close()  # cancelled while queueing: the abort follows the add, whichever won
            raise
        return stream

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None, *, arrival_time: float | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's RequestOutput after each step that advanced it, the last one finished.

        Each output is cumulative (full text and token ids so far, as vLLM's default). Closing the
        generator (or cancelling the task iterating it) before the end aborts the request."""
        stream = await self.add_request(prompt, params, request_id, arrival_time=arrival_time, priority=priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    @property
    def supports_generation(self) -> bool:
        return self.engine.runner is not None

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its stream ends with finish_reason "abort"."""
        self._submit(Abort(request_id))

    async def shutdown(self) -> None:
        """Abort every request (their streams raise EngineDeadError) and stop the engine thread."""
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Blocking `shutdown` for code without an event loop."""
        self._commands.stop()
        batcher = self._take_batcher()
        self._thread.join()
        if batcher is not None:
            batcher.close()

    def _forget(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    def _stream_closed(self, stream: RequestStream) -> None:
        if stream.done:
            self._forget(stream)
        else:  # closed early; the abort's confirmation removes the stream
            self._submit(Abort(stream.request_id, stream.loop))

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_error}") from self.dead_error
        if self._commands.stopping or not self._thread.is_alive():
            raise EngineShutDownError("the engine is shut down")

    def _submit(self, command: Command) -> None:
        self._commands.submit(command)

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        with young_collections_spaced():
            self._serve()

    def _serve(self) -> None:
        try:
            while True:
                # Multi-host: an idle rank 0 pings its followers now and then (heartbeat), so they never sit
                # in one collective long enough for the transport to time out.
                commands, stopping = self._commands.take(
                    idle=not self.engine.has_unfinished_requests(), heartbeat_s=self.engine.heartbeat_interval_s,
                    heartbeat=self.engine.heartbeat, burst_cap_s=self._burst_cap_s(), burst_gap_s=self.burst_gap_s)
                for command in commands:
                    self._apply(command)
                if stopping:
                    self._abort_all(EngineShutDownError("the engine is shut down"))
                    return
                stepped = self.engine.has_unfinished_requests()
                if stepped:
                    self._step()
                self._publish_stats(stepped)
                if self.dead_error is not None:
                    return
        except BaseException as error:  # a bug in this loop: nobody could be served any more
            logger.exception("the engine thread crashed")
            self._die(error)
        finally:
            self._exit()

    def _burst_cap_s(self) -> float:
        """How long an idle engine may wait for a burst of requests: a fraction of a recent step, capped."""
        if self._step_seconds is None:
            return self.max_burst_wait_s
        return min(self.max_burst_wait_s, BURST_WAIT_STEP_FRACTION * self._step_seconds)

    def _exit(self) -> None:
        """Refuse what was queued after the last look at the command list; nothing will apply it now."""
        if self.engine.arrivals == self._commands.has_adds:
            self.engine.arrivals = None  # the Engine may outlive this wrapper
        for command in self._commands.close():
            if isinstance(command, Add):
                if command.future.set_running_or_notify_cancel():
                    command.future.set_exception(EngineDeadError("the engine is not running"))
            elif command.loop is not None:
                self._post(command.loop, self._end, [command.request_id])

    def _apply(self, command: Command) -> None:
        if isinstance(command, Abort):
            loop = self._loops.pop(command.request_id, None) or command.loop
            self.engine.abort_request(command.request_id)
            stream = self._streams.get(command.request_id)
            if stream is not None and stream.closed:
                # Its reader is gone: forget it here. A loop that is closing (asyncio.run returning right after
                # a cancel) can drop the callback below, and a stream left behind would hold its request id.
                self._forget(stream)
            if loop is not None and stream is not None:  # no stream: nothing to end on the caller's loop
                self._post(loop, self._end_streams, [stream])
            return
        if not command.future.set_running_or_notify_cancel():
            return  # the caller gave up before the request was queued
        try:
            # The limit counts sequences (n per prompt); those the next step can still admit do not wait.
            waiting = self.engine.num_waiting_past_capacity()
            if self.max_waiting_requests is not None and waiting + command.params.n > self.max_waiting_requests:
                raise QueueFullError(f"the waiting queue is full ({max(waiting, 0)} sequences waiting, "
                                     f"{command.params.n} more asked); retry later")
            self.engine.add_request(command.request_id, command.prompt, command.params, command.arrival_time,
                                    command.priority)
        except Exception as error:
            command.future.set_exception(error)
            return
        self._loops[command.request_id] = command.loop
        command.future.set_result(None)

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as error:
            self._step_failed(error)
            return
        self._failures = 0
        seconds = time.perf_counter() - started
        self._step_seconds = seconds if self._step_seconds is None else 0.8 * self._step_seconds + 0.2 * seconds
        by_loop: dict[asyncio.AbstractEventLoop, list[RequestOutput]] = {}
        for output in outputs:
            loop = self._loops.get(output.request_id)
            if loop is None:
                continue  # added by someone else (e.g. a direct Engine.generate), not ours
            if output.finished:
                del self._loops[output.request_id]
            by_loop.setdefault(loop, []).append(output)
        for loop, batch in by_loop.items():
            self._post(loop, self._deliver, batch)

    def _step_failed(self, error: Exception) -> None:
        """Fail the requests that were in the failed batch; a run of failures means the engine is dead."""
        self._failures += 1
        logger.error("engine step failed (%d in a row): %r", self._failures, error, exc_info=error)
        affected = self.engine.running_request_ids() or set(self._loops)
        try:
            self.engine.abort_request(list(affected))
        except Exception as cleanup_error:
            logger.exception("could not clean up after a failed step")
            self._die(cleanup_error)
            return
        fatal = self._failures >= _MAX_CONSECUTIVE_STEP_FAILURES
        if fatal:
            self.dead_error = error  # before anyone hears of the failure, so nobody adds more work
        failure = EngineStepError(f"the engine failed while running this request: {error!r}")
        failure.__cause__ = error
        self._fail(affected, failure)
        if fatal:
            self._die(error)

    def _die(self, error: BaseException) -> None:
        self.dead_error = error
        self._abort_all(EngineDeadError(f"the engine is dead: {error!r}"))

    def _abort_all(self, error: BaseException) -> None:
        ids = list(self._loops)
        try:
            self.engine.abort_request(ids)
        except Exception:
            logger.exception("aborting every request failed")
        self._fail(ids, error)

    def _fail(self, request_ids: Any, error: BaseException) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[str]] = {}
        for request_id in request_ids:
            loop = self._loops.pop(request_id, None)
            if loop is not None:
                by_loop.setdefault(loop, []).append(request_id)
        for loop, ids in by_loop.items():
            self._post(loop, self._end, ids, error)

    def _publish_stats(self, stepped: bool) -> None:
        self.stats = self.engine.stats(num_steps=self.stats.num_steps + int(stepped))

    def _post(self, loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> None:
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            for item in args[0]:
                request_id = item if isinstance(item, str) else item.request_id  # an id, output or stream
                self._loops.pop(request_id, None)
                self._streams.pop(request_id, None)  # its loop is gone, so no reader can race this
                self.engine.abort_request(request_id)

    # ---- on the callers' event loops ------------------------------------------------------------
    def _observe(self, output: RequestOutput) -> None:
        for observer in self.observers:
            try:
                observer(output)
            except Exception:
                logger.exception("an output observer failed")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._observe(output)
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
                if output.finished and stream.closed:
                    self._forget(stream)

    def _end(self, request_ids: list[str], error: BaseException | None = None) -> None:
        """Requests stopped from outside: observers see them end as "abort"; readers get that, or `error`."""
        self._end_streams([s for s in map(self._streams.get, request_ids) if s is not None], error)

    def _end_streams(self, streams: list[RequestStream], error: BaseException | None = None) -> None:
        for stream in streams:
            if not stream.done:
                final = aborted_output(stream.request_id, stream)
                self._observe(final)
                stream.put(error or final)
            if stream.closed:
                self._forget(stream)
