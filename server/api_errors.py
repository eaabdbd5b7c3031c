"""The errors a request handler raises for its client: light to import (the command line's flags module reads
them without loading the web framework); server.errors turns them into responses."""
from __future__ import annotations


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


class ClientGone(Exception):
    """The client closed the connection before its response was ready."""


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)
