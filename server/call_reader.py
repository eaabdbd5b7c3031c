"""One JSON tool-call object read as it is written: its name once known, its argument text as it arrives."""
from __future__ import annotations

import re

_WHITESPACE = " \t\r\n"
_STRING_SPECIAL = re.compile(r'["\\]')
_NESTED_SPECIAL = re.compile(r'[\[\]{}"]')
_SCALAR_END = re.compile(r"[,}\]\s]")
_PLAIN = re.compile(r"[^\\]+")
_HEX = re.compile(r"[0-9a-fA-F]{4}")
_HIGH = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}")
_LOW = re.compile(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_ESCAPES = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _string_end(text: str, pos: int, escaped: bool) -> tuple[int, bool, bool]:
    """Reads a JSON string's body from `pos` -> (position reached, closed (past the quote), escape pending)."""
    while pos < len(text):
        if escaped:
            pos, escaped = pos + 1, False
            continue
        found = _STRING_SPECIAL.search(text, pos)
        if found is None:
            return len(text), False, False
        pos = found.start()
        if text[pos] == "\\":
            pos, escaped = pos + 1, True
            continue
        return pos + 1, True, False
    return pos, False, escaped


def _decoded_prefix(raw: str, closed: bool) -> tuple[str, int]:
    """The complete escapes and characters at the start of a JSON string's raw body -> (their text, raw characters
    used). An escape cut short (or a high surrogate whose low half may follow) waits for more unless the string
    is closed; an invalid escape is its character without the backslash; a lone surrogate is U+FFFD."""
    out, pos = [], 0
    while pos < len(raw):
        plain = _PLAIN.match(raw, pos)
        if plain:
            out.append(plain.group())
            pos = plain.end()
            continue
        unit = raw[pos:pos + 12]
        if len(unit) < 2 or (unit[1] == "u" and len(unit) < 6) or (
                _HIGH.match(unit) and len(unit) < 12 and not closed):
            if not closed:
                break
            out.append(unit[1:])  # an escape the string ends in the middle of
            pos = len(raw)
            continue
        if unit[1] != "u" or not _HEX.fullmatch(unit[2:6]):
            out.append(_ESCAPES.get(unit[1], unit[1]))
            pos += 2
            continue
        code = int(unit[2:6], 16)
        if _HIGH.match(unit) and _LOW.fullmatch(unit[6:12]):
            out.append(chr(0x10000 + ((code - 0xD800) << 10) + int(unit[8:12], 16) - 0xDC00))
            pos += 12
            continue
        out.append("\ufffd" if 0xD800 <= code < 0xE000 else chr(code))
        pos += 6
    return "".join(out), pos


class CallReader:
    """One call object, read from just after its `{`: its name as soon as it is known, its arguments as raw JSON
    text (or, when a model encodes them as a JSON string, that string's text), buffered until the name is known."""

    def __init__(self, argument_keys: tuple[str, ...], names: tuple[str, ...] | None):
        self.argument_keys, self.names = argument_keys, names
        self.name: str | None = None
        self.index: int | None = None  # set once the stream has announced the call
        self.has_arguments = False
        self._arguments = ""  # argument text not yet taken
        self._state = "key"
        self._key = ""
        self._start = 0  # where the current string, or the unread part of the arguments string, begins
        self._escaped = False
        self._depth = 0
        self._in_string = False  # inside a string of an object or list value
        self._name_read = False
        self._prefix: int | None = 0  # name prefixes shorter than this match several names (None: settled)
        if names is not None and len(names) == 1:
            self.name = names[0]

    def take_arguments(self) -> str:
        text, self._arguments = self._arguments, ""
        return text

    def read(self, text: str, pos: int) -> tuple[int, str]:
        """-> (position reached, status): "more" (needs text), "done" (past the closing `}`) or "broken"."""
        while pos < len(text):
            state = self._state
            if state in ("key", "colon", "value", "after"):
                while pos < len(text) and text[pos] in _WHITESPACE:
                    pos += 1
                if pos == len(text):
                    break
            char = text[pos]
            if state == "key":
                if char == "}":
                    return pos + 1, "done"
                if char != '"':
                    return pos, "broken"
                self._state, self._start, pos = "key_string", pos + 1, pos + 1
            elif state == "colon":
                if char != ":":
                    return pos, "broken"
                self._state, pos = "value", pos + 1
            elif state == "after":
                if char == "}":
                    return pos + 1, "done"
                if char != ",":
                    return pos, "broken"
                self._state, pos = "key", pos + 1
            elif state == "value":
                pos = self._value(char, pos)
                if self._state == "broken":
                    return pos, "broken"
            elif state in ("key_string", "name", "skip_string"):
                pos = self._string(text, pos)
            elif state == "arguments_string":
                pos = self._arguments_string(text, pos)
            elif state in ("arguments", "skip_nested"):
                pos = self._nested(text, pos)
            else:  # skip_scalar
                found = _SCALAR_END.search(text, pos)
                pos = len(text) if found is None else found.start()
                if found is not None:
                    self._state = "after"
        return pos, "more"

    def _value(self, char: str, pos: int) -> int:
        if self._key == "name" and not self._name_read:
            if char != '"':
                self._state = "broken"
                return pos
            self._state, self._start = "name", pos + 1
            return pos + 1
        if self._key in self.argument_keys and not self.has_arguments:
            if char not in '{["':
                self._state = "broken"
                return pos
            self.has_arguments = True
            if char == '"':
                self._state, self._start = "arguments_string", pos + 1
                return pos + 1
            self._state, self._depth = "arguments", 0
            return pos
        if char in "{[":
            self._state, self._depth = "skip_nested", 0
            return pos
        if char == '"':
            self._state = "skip_string"
            return pos + 1
        self._state = "skip_scalar"
        return pos

    def _string(self, text: str, pos: int) -> int:
        """Key, name and skipped strings: read to the closing quote."""
        end, closed, self._escaped = _string_end(text, pos, self._escaped)
        if self._state == "name" and self.names is not None and self.name is None:
            self._resolve(text[self._start:end - 1 if closed else end])
        if closed:
            body = text[self._start:end - 1]
            if self._state == "key_string":
                self._key, self._state = _decoded_prefix(body, True)[0], "colon"
            else:
                if self._state == "name":
                    self._name_read = True
                    if self.name is None:
                        self.name = _decoded_prefix(body, True)[0]
                self._state = "after"
        return end

    def _resolve(self, seen: str) -> None:
        """Names the call by the first prefix of its name that only one of the names starts with (whatever the
        text's pieces); a prefix no name starts with leaves the name to its closing quote."""
        while self._prefix is not None and self._prefix <= len(seen):
            candidates = [name for name in self.names or () if name.startswith(seen[:self._prefix])]
            if len(candidates) <= 1:
                self.name, self._prefix = (candidates[0] if candidates else None), None
                return
            self._prefix += 1

    def _arguments_string(self, text: str, pos: int) -> int:
        end, closed, self._escaped = _string_end(text, pos, self._escaped)
        raw = text[self._start:end - 1 if closed else end]
        decoded, used = _decoded_prefix(raw, closed)
        self._arguments += decoded
        self._start += used
        if closed:
            self._state = "after"
        return end

    def _nested(self, text: str, pos: int) -> int:
        """An object or list value (the arguments, kept; another key's, skipped), to its closing bracket."""
        start, keep = pos, self._state == "arguments"
        while pos < len(text):
            if self._in_string:
                pos, closed, self._escaped = _string_end(text, pos, self._escaped)
                self._in_string = not closed
                continue
            found = _NESTED_SPECIAL.search(text, pos)
            if found is None:
                pos = len(text)
                break
            pos, char = found.end(), found.group()
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    self._state = "after"
                    break
        if keep:
            self._arguments += text[start:pos]
        return pos
