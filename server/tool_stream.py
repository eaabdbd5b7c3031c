"""Tool calls read while they are written: content, then each call's name, then its argument text, piece by piece."""
from __future__ import annotations

import dataclasses

from server.call_reader import CallReader
from server.reasoning import partial_tag

_WHITESPACE = " \t\r\n"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a model's calls sit in its reply and what each call object looks like."""

    marker: str = ""  # text that opens calls anywhere in the reply ("": calls can only open the reply)
    end_tag: str = ""  # text that closes each block of calls
    prefix: str = ""  # optional text before the calls when they open the reply
    lists: bool = False  # calls may come as a JSON list
    separator: str = ""  # between calls outside a list
    argument_keys: tuple[str, ...] = ("arguments", "parameters")
    prose: bool = True  # text outside calls is content (False: it is dropped)
    names: tuple[str, ...] | None = None  # the only names a call can have (a grammar's): a unique prefix names it


@dataclasses.dataclass
class CallPiece:
    """What one feed adds to call `index`: its name (on the call's first piece only) and argument text."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclasses.dataclass
class Pieces:
    """What one feed adds to the reply: content text and call pieces (one per call it touched)."""

    content: str = ""
    calls: list[CallPiece] = dataclasses.field(default_factory=list)

    def call(self, index: int) -> CallPiece:
        for piece in self.calls:
            if piece.index == index:
                return piece
        piece = CallPiece(index)
        self.calls.append(piece)
        return piece

    def merge(self, later: Pieces) -> None:
        self.content += later.content
        for piece in later.calls:
            mine = self.call(piece.index)
            mine.name = piece.name if piece.name is not None else mine.name
            mine.arguments += piece.arguments


class CallStream:
    """Feeds one reply's text (whole or in pieces) -> the Pieces each feed adds. Text outside calls is content
    (whitespace held until it is followed by more content); a call is announced once its name is known and its
    argument text follows as it arrives; text that turns out not to be a call before its name is known is
    content. A reply cut inside a call leaves that call partial; a cut before its name drops it."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.calls = 0  # calls announced
        self._text = ""
        self._pos = 0
        self._state = "outside" if layout.marker else "start"
        self._segment = 0  # where the text read as a possible call begins
        self._pending = ""  # outside text held back: whitespace not yet followed by content
        self._wrote_content = False
        self._in_list = False
        self._call: CallReader | None = None
        self._out = Pieces()
        self._cut = False

    def start(self) -> Pieces:
        """Before any text: a call that a grammar makes certain and names (one function to choose from)."""
        self._out = Pieces()
        if not self.layout.marker and self.layout.names is not None and len(self.layout.names) == 1:
            self._call = CallReader(self.layout.argument_keys, self.layout.names)
            self._announce(self._call)
        return self._out

    def feed(self, text: str, final: bool, cut: bool = False) -> Pieces:
        """`cut`: the final text ends where max_tokens cut it, so a marker begun there is a call's, not content."""
        self._out, self._cut = Pieces(), cut
        self._text += text
        while getattr(self, f"_{self._state}")(final):
            pass
        if final:
            if self._state == "start":  # only whitespace: no call began
                self._diverge()
            if self.layout.prose and not self.calls and self._pending:
                self._out.content += self._pending
            self._pending = ""
        if self._state in ("outside", "prose", "drop"):  # nothing before the position is needed again
            self._text, self._pos = self._text[self._pos:], 0
        return self._out

    def _write(self, text: str) -> None:
        if not self.layout.prose or not text:
            return
        self._pending += text
        written = self._pending.rstrip(_WHITESPACE)  # trailing whitespace waits for what follows it
        if written:
            self._out.content += written
            self._pending, self._wrote_content = self._pending[len(written):], True

    def _skip_space(self) -> bool:
        """Moves past whitespace -> whether a character follows."""
        while self._pos < len(self._text) and self._text[self._pos] in _WHITESPACE:
            self._pos += 1
        return self._pos < len(self._text)

    def _after_calls(self) -> str:
        return "outside" if self.layout.marker else "prose" if self.layout.prose else "drop"

    def _diverge(self) -> bool:
        """The text since the segment began is not a call: it is content, and reading goes on outside calls."""
        self._write(self._text[self._segment:self._pos])
        self._state, self._call, self._in_list = self._after_calls(), None, False
        return True

    def _outside(self, final: bool) -> bool:
        found = self._text.find(self.layout.marker, self._pos)
        if found < 0:  # a marker's start at the end waits: when the reply ends there, it is content unless cut
            end = len(self._text) - partial_tag(self._text[self._pos:], self.layout.marker)
            self._write(self._text[self._pos:end])
            if final and not self.calls and not self._cut:
                self._write(self._text[end:])
            self._pos = len(self._text) if final else end
            return False
        self._write(self._text[self._pos:found])
        if not self.calls and self._wrote_content:  # whitespace between the content and the first call is content
            self._out.content += self._pending
            self._pending = ""
        self._segment, self._pos, self._state = found, found + len(self.layout.marker), "open"
        return True

    def _start(self, final: bool) -> bool:
        if not self._skip_space():
            return False
        prefix, rest = self.layout.prefix, self._text[self._pos:self._pos + len(self.layout.prefix)]
        if prefix and rest == prefix:
            self._pos += len(prefix)
        elif prefix and prefix.startswith(rest):
            if not final:
                return False
            if self._cut:  # the prefix of a call that max_tokens cut
                self._state = "drop"
                return True
        self._state = "open"
        return True

    def _open(self, final: bool) -> bool:
        if not self._skip_space():
            return False
        char = self._text[self._pos]
        self._in_list = char == "[" and self.layout.lists
        if self._in_list:
            self._pos, self._state = self._pos + 1, "item"
            return True
        if char == "{":
            return self._open_call()
        return self._diverge()

    def _item(self, final: bool) -> bool:
        if not self._skip_space():
            return False
        char = self._text[self._pos]
        if char == "{":
            return self._open_call()
        if char == "]":
            self._pos, self._in_list, self._state = self._pos + 1, False, "after_block"
            return True
        return self._diverge()

    def _open_call(self) -> bool:
        self._pos += 1
        if self._call is None:
            self._call = CallReader(self.layout.argument_keys, self.layout.names)
        self._state = "reading"
        return True

    def _announce(self, call: CallReader) -> None:
        call.index, self.calls = self.calls, self.calls + 1
        self._out.call(call.index).name = call.name

    def _reading(self, final: bool) -> bool:
        call = self._call
        assert call is not None
        self._pos, status = call.read(self._text, self._pos)
        if call.index is None and call.name is not None:
            self._announce(call)
        if call.index is not None:
            arguments = call.take_arguments()
            if arguments:
                self._out.call(call.index).arguments += arguments
        if status == "more":
            return False
        if call.index is None:  # an object without a name, or not a call object at all
            return self._diverge()
        if status == "broken":
            self._call, self._state = None, "skip"
            return True
        if not call.has_arguments:
            self._out.call(call.index).arguments += "{}"
        self._call, self._segment, self._state = None, self._pos, "after_call"
        return True

    def _after_call(self, final: bool) -> bool:
        if not self._in_list:
            self._state = "after_block"
            return True
        if not self._skip_space():
            return False
        char = self._text[self._pos]
        if char == ",":
            self._pos, self._state = self._pos + 1, "item"
        elif char == "]":
            self._pos, self._in_list, self._state = self._pos + 1, False, "after_block"
        else:
            self._in_list, self._state = False, "after_block"
        return True

    def _after_block(self, final: bool) -> bool:
        """After a call or a list of calls: the block's end tag, or a separator and the next call."""
        closing = self.layout.end_tag or self.layout.separator
        if closing:
            if not self._skip_space():
                return False
            rest = self._text[self._pos:self._pos + len(closing)]
            if closing.startswith(rest) and len(rest) < len(closing):
                if not final:
                    return False
                self._pos += len(rest)  # a cut end tag belongs to the call
            elif rest == closing:
                self._pos += len(closing)
                if not self.layout.end_tag:  # a separator: the next call follows
                    self._segment, self._state = self._pos - len(closing), "open"
                    return True
        self._segment, self._state = self._pos, self._after_calls()
        return True

    def _skip(self, final: bool) -> bool:
        """Past a call whose object broke after its name was announced: to its block's end tag, else to the end."""
        if not self.layout.end_tag:
            self._state = "drop"
            return True
        found = self._text.find(self.layout.end_tag, self._pos)
        if found < 0:
            self._pos = len(self._text) - partial_tag(self._text[self._pos:], self.layout.end_tag)
            return False
        self._pos, self._state = found + len(self.layout.end_tag), "outside"
        return True

    def _prose(self, final: bool) -> bool:
        self._write(self._text[self._pos:])
        self._pos = len(self._text)
        return False

    def _drop(self, final: bool) -> bool:
        self._pos = len(self._text)
        return False

