"""Finished responses kept in memory for `previous_response_id` and GET /v1/responses/{id}: the most recent ones."""
from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict

from server.protocol import ChatMessage

DEFAULT_MAX_STORED_RESPONSES = 1024


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object as it was returned
    messages: list[ChatMessage]  # the whole conversation, this response's reply last (instructions left out)


class ResponseStore:
    """At most `capacity` responses; storing one more forgets the least recently stored or read."""

    def __init__(self, capacity: int = DEFAULT_MAX_STORED_RESPONSES):
        if capacity < 1:
            raise ValueError("the response store needs room for at least one response")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        with self._lock:
            self._entries[response_id] = entry
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def __len__(self) -> int:
        return len(self._entries)
