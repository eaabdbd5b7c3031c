"""`jvllm chat`: a terminal chat streaming replies from a server (--url, SSE over httpx) or an in-process engine."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import pathlib
import signal
import sys
import threading
from typing import Any, AsyncIterator, Callable, Iterator

try:
    import termios
except ImportError:  # not a POSIX terminal (Windows)
    termios = None

from jvllm.engine.arg_utils import EngineArgs

Messages = list[dict[str, str]]
ReplyFn = Callable[[Messages], AsyncIterator[str]]


class ChatError(Exception):
    """The server refused the request or failed mid-stream."""


async def sse_events(response: Any) -> AsyncIterator[dict]:
    """JSON payloads of an OpenAI-style SSE response (an httpx streaming response) up to `[DONE]`."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if isinstance(event, dict) and event.get("error"):
            raise ChatError(event["error"].get("message", "error"))
        yield event


def _error_message(body: bytes, status: int) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}"


def http_replier(client: Any, url: str, model: str, settings: dict[str, Any]) -> ReplyFn:
    async def reply(messages: Messages) -> AsyncIterator[str]:
        payload = {"model": model, "messages": messages, "stream": True, **settings}
        async with client.stream("POST", f"{url}/chat/completions", json=payload) as response:
            if response.status_code != 200:
                raise ChatError(_error_message(await response.aread(), response.status_code))
            async for event in sse_events(response):
                for choice in event.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        yield piece
    return reply


def engine_replier(engine: Any, settings: dict[str, Any]) -> ReplyFn:
    from jvllm.sampling_params import SamplingParams

    async def reply(messages: Messages) -> AsyncIterator[str]:
        text = engine.apply_chat_template(messages, add_generation_prompt=True)
        ids = engine.tokenize(text, add_special_tokens=False)
        room = engine.max_model_len - len(ids)
        if room < 1:
            raise ChatError("the conversation no longer fits the context; /clear starts afresh")
        params = SamplingParams(temperature=settings["temperature"], top_p=settings["top_p"],
                                max_tokens=min(settings["max_tokens"], room))
        sent = 0
        async for output in engine.generate({"prompt": text, "prompt_token_ids": ids}, params):
            text_so_far = output.outputs[0].text
            if len(text_so_far) > sent:
                yield text_so_far[sent:]
                sent = len(text_so_far)
    return reply


HELP = "commands: /clear or /reset (start afresh), /system TEXT (set the system message), /save PATH, /exit"


async def converse(reply: ReplyFn, system: str | None, quick: str | None,
                   read: Callable[[str], str] = input, write: Callable[[str], Any] | None = None) -> None:
    """The read-reply loop: each reply streams to `write` (default: stdout) as it arrives. Ctrl-C during a reply
    stops it and keeps the conversation (the partial reply included); at the prompt it quits. Commands: HELP."""
    if write is None:
        def write(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()
    messages: Messages = [{"role": "system", "content": system}] if system else []
    while True:
        if quick is not None:
            line = quick
        else:
            try:
                line = await asyncio.to_thread(read, "> ")
            except EOFError:
                write("\n")
                return
        line = line.strip()
        if line in ("/exit", "/quit"):
            return
        if line.startswith("/"):
            messages = _command(line, messages, write)
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        try:
            with _typing_held(read is input):
                text, stopped = await _streamed(reply(messages), write)
        except ChatError as error:
            write(f"[error: {error}]")
            messages.pop()
        else:
            messages.append({"role": "assistant", "content": text})
            if stopped:
                write(" [stopped]")
        write("\n")
        if quick is not None:
            return


def _command(line: str, messages: Messages, write: Callable[[str], Any]) -> Messages:
    """A /command at the prompt -> the conversation after it."""
    name, _, argument = line.partition(" ")
    argument = argument.strip()
    system = [m for m in messages[:1] if m["role"] == "system"]
    if name in ("/clear", "/reset"):
        return system
    if name == "/system" and argument:
        write("system message set; the conversation starts afresh\n")
        return [{"role": "system", "content": argument}]
    if name == "/save" and argument:
        try:
            pathlib.Path(argument).write_text(json.dumps({"messages": messages}, indent=1, ensure_ascii=False) + "\n")
        except OSError as error:
            write(f"[cannot save: {error}]\n")
        else:
            write(f"saved {len(messages)} messages to {argument}\n")
        return messages
    write(HELP + "\n")
    return messages


async def _streamed(pieces: AsyncIterator[str], write: Callable[[str], Any]) -> tuple[str, bool]:
    """Writes the reply's pieces as they arrive -> (the reply's text, whether Ctrl-C stopped it)."""
    parts: list[str] = []

    async def consume() -> None:
        async for piece in pieces:
            write(piece)
            parts.append(piece)

    task = asyncio.ensure_future(consume())
    with _interrupt_cancels(task) as interrupted:
        try:
            await task
        except asyncio.CancelledError:
            if not interrupted:  # this coroutine itself is being cancelled
                raise
    return "".join(parts), bool(interrupted)


@contextlib.contextmanager
def _interrupt_cancels(task: asyncio.Future) -> Iterator[list[bool]]:
    """While inside, SIGINT (Ctrl-C) cancels `task` instead of raising KeyboardInterrupt; -> a list that holds True
    once that happened. Signal handlers belong to the main thread: elsewhere nothing changes."""
    interrupted: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return
    loop = asyncio.get_running_loop()

    def on_interrupt(_signum: int, _frame: Any) -> None:
        interrupted.append(True)
        loop.call_soon_threadsafe(task.cancel)

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _typing_held(terminal: bool) -> Iterator[None]:
    """While a reply streams to a terminal, keys typed are neither echoed into it nor read as the next message
    (echo and line editing off, pending input dropped at the end; Ctrl-C still signals)."""
    fd = sys.stdin.fileno() if terminal and sys.stdin is not None and sys.stdin.isatty() else None
    if fd is None or termios is None:
        yield
        return
    saved = termios.tcgetattr(fd)
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | termios.ICANON)  # local modes
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcflush(fd, termios.TCIFLUSH)
        termios.tcsetattr(fd, termios.TCSANOW, saved)


async def _run(args: argparse.Namespace, engine_args: EngineArgs) -> None:
    settings = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p}
    if args.url:
        import httpx

        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        url = args.url.rstrip("/")
        try:
            async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(None, connect=10.0)) as client:
                model = args.model
                if model is None:
                    listing = await client.get(f"{url}/models")
                    if listing.status_code != 200:
                        raise ChatError(_error_message(listing.content, listing.status_code))
                    model = listing.json()["data"][0]["id"]
                await converse(http_replier(client, url, model, settings), args.system, args.quick)
        except httpx.HTTPError as error:
            raise ChatError(f"cannot talk to {url}: {error}") from None
        return
    from jvllm.engine.async_engine import AsyncEngine

    with _startup_progress(not args.quiet):
        engine = AsyncEngine.from_engine_args(engine_args)
    try:
        await converse(engine_replier(engine, settings), args.system, args.quick)
    finally:
        await engine.shutdown()


@contextlib.contextmanager
def _startup_progress(show: bool) -> Iterator[None]:
    """While the engine loads, its progress lines (each phase and its time) show at INFO, unless the user set
    JVLLM_LOGGING_LEVEL; the conversation then runs at WARNING."""
    logger = logging.getLogger("jvllm")
    if not show or os.environ.get("JVLLM_LOGGING_LEVEL"):
        yield
        return
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.setLevel(logging.NOTSET)


def run_chat(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        asyncio.run(_run(args, engine_args))
    except KeyboardInterrupt:
        print()
    except (ChatError, ValueError, FileNotFoundError, OSError) as error:
        print(f"jvllm: error: {error}", file=sys.stderr)
        return 2
    return 0
