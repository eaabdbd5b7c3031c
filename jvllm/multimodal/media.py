"""Images from URLs: `data:` URLs, local files under an allowed folder only, and http(s) with a timeout and a size
limit. Every refusal is a ValueError naming the reason (a 400 over HTTP)."""
from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
from pathlib import Path
from typing import Any

DEFAULT_FETCH_TIMEOUT_S = 10.0
DEFAULT_MAX_IMAGE_BYTES = 20 << 20
MAX_IMAGE_PIXELS = 64 << 20  # decoded width x height; larger files are refused before decoding (decompression bombs)


class MediaLoader:
    """Loads images the way vLLM's `--allowed-local-media-path` and media fetch settings describe."""

    def __init__(self, allowed_local_media_path: str | None = None, *, timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
                 max_bytes: int = DEFAULT_MAX_IMAGE_BYTES):
        self.allowed_root = None
        if allowed_local_media_path:
            root = Path(allowed_local_media_path).expanduser()
            if not root.is_dir():
                raise ValueError(f"allowed_local_media_path {allowed_local_media_path!r} is not a directory")
            self.allowed_root = root.resolve()
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes

    def load_image(self, url: str) -> Any:
        """-> a decoded PIL image (RGB conversion is the image processor's job)."""
        if not isinstance(url, str) or not url:
            raise ValueError("an image URL must be a non-empty string")
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme == "data":
            return decode_image(_data_url_bytes(url))
        if scheme == "file":
            return decode_image(self._local_bytes(url))
        if scheme in ("http", "https"):
            return decode_image(self._fetch(url))
        raise ValueError(f"unsupported image URL scheme {scheme!r}: use data:, file: (under "
                         "--allowed-local-media-path) or http(s):")

    def _local_bytes(self, url: str) -> bytes:
        if self.allowed_root is None:
            raise ValueError("local image files are refused: the engine runs without allowed_local_media_path "
                             "(--allowed-local-media-path)")
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file URLs must name a local path, not host {parts.netloc!r}")
        path = Path(urllib.parse.unquote(parts.path)).resolve()  # symlinks and '..' resolved before the check
        if os.path.commonpath([path, self.allowed_root]) != str(self.allowed_root):
            raise ValueError(f"the image path {str(path)!r} is outside the allowed local media path")
        if not path.is_file():
            raise ValueError(f"no image file at {str(path)!r}")
        if path.stat().st_size > self.max_bytes:
            raise ValueError(f"the image file is larger than {self.max_bytes} bytes")
        return path.read_bytes()

    def _fetch(self, url: str) -> bytes:
        import httpx

        try:
            with httpx.stream("GET", url, timeout=self.timeout_s, follow_redirects=True) as response:
                if response.status_code != 200:
                    raise ValueError(f"fetching the image failed: HTTP {response.status_code} from {url}")
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                    raise ValueError(f"the image at {url} is larger than {self.max_bytes} bytes")
                body = bytearray()
                for piece in response.iter_bytes():
                    body += piece
                    if len(body) > self.max_bytes:
                        raise ValueError(f"the image at {url} is larger than {self.max_bytes} bytes")
                return bytes(body)
        except httpx.TimeoutException:
            raise ValueError(f"fetching the image timed out after {self.timeout_s} s: {url}") from None
        except httpx.HTTPError as error:
            raise ValueError(f"fetching the image failed: {error}") from None


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise ValueError("a data URL needs a ',' before its payload")
    media_type = header[len("data:"):].split(";")[0].lower()
    if media_type and not media_type.startswith("image/"):
        raise ValueError(f"a data URL of type {media_type!r} is not an image")
    if not header.lower().endswith(";base64"):
        return urllib.parse.unquote_to_bytes(payload)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the data URL's base64 payload is invalid") from None


def decode_image(data: bytes) -> Any:
    """Image file bytes -> a loaded PIL image; ValueError for anything PIL cannot decode."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise ValueError(f"the image is {image.width}x{image.height} pixels, over the {MAX_IMAGE_PIXELS} limit")
        image.load()
        return image
    except ValueError:
        raise
    except Exception as error:  # UnidentifiedImageError, truncated files, decoder errors
        raise ValueError(f"could not decode the image: {error}") from None
