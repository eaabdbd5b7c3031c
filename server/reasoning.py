"""--reasoning-parser: the text a reasoning model writes between `<think>` and `</think>` becomes
`reasoning_content`, the rest `content` (whole replies and stream deltas)."""
from __future__ import annotations

import dataclasses

from jvllm.structured.reasoning import REASONING_ENDS

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = tuple(REASONING_ENDS)


@dataclasses.dataclass
class SplitReply:
    reasoning: str | None
    content: str | None


def split_reasoning(parser: str, text: str) -> SplitReply:
    """deepseek_r1: everything before `</think>` is reasoning (its template opens the block, so an unfinished
    reply is all reasoning); qwen3: only a closed `<think>...</think>` block is (otherwise all content)."""
    head, found, tail = text.partition(THINK_END)
    if not found:
        return SplitReply(_strip_start(text), None) if parser == "deepseek_r1" else SplitReply(None, text)
    return SplitReply(_strip_start(head), tail or None)


def _strip_start(text: str) -> str:
    return text[len(THINK_START):] if text.startswith(THINK_START) else text


class ReasoningStream:
    """Splits a streamed reply as split_reasoning splits the whole: feed() each new piece of text, get back
    (reasoning delta, content delta). A piece that could begin a tag is held until the next one."""

    def __init__(self, parser: str):
        self.parser = parser
        self._text = ""  # everything received
        self._sent = 0  # characters of _text already given out
        self._thinking: bool | None = True if parser == "deepseek_r1" else None  # None: not known yet (qwen3)

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        self._text += piece
        reasoning, content = "", ""
        while self._sent < len(self._text):
            rest = self._text[self._sent:]
            if self._thinking is None:  # qwen3: a reply that opens with <think> is reasoning first
                if THINK_START.startswith(rest) and not final:
                    break
                self._thinking = rest.startswith(THINK_START)
                if self._thinking:
                    self._sent += len(THINK_START)
                continue
            if not self._thinking:
                content += rest
                self._sent = len(self._text)
                break
            if self._sent == 0 and THINK_START.startswith(rest) and not final:
                break  # maybe the opening tag, not complete yet
            if self._sent == 0 and rest.startswith(THINK_START):
                self._sent += len(THINK_START)
                continue
            end = rest.find(THINK_END)
            if end >= 0:
                reasoning += rest[:end]
                self._sent += end + len(THINK_END)
                self._thinking = False
                continue
            keep = 0 if final else partial_tag(rest, THINK_END)
            reasoning += rest[:len(rest) - keep]
            self._sent += len(rest) - keep
            break
        return reasoning, content


def partial_tag(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
