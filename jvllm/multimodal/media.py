"""Images from URLs: `data:` URLs, local files under an allowed folder only, and http(s) from public addresses (or
the operator's allowed hosts) with a time and size limit; decoded sizes are bounded too. Every refusal is a
ValueError naming the reason (a 400 over HTTP)."""
from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import warnings
from pathlib import Path
from typing import Any, Iterable

from jvllm.multimodal.http_fetch import fetch
from jvllm.multimodal.url_policy import UrlPolicy
from jvllm.utils import check_positive

DEFAULT_FETCH_TIMEOUT_S = 10.0
DEFAULT_MAX_IMAGE_BYTES = 20 << 20
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096  # decoded width x height; larger images are refused before decoding


class MediaLoader:
    """Loads images the way vLLM's `--allowed-local-media-path`, `--allowed-media-domains` and media fetch settings
    describe."""

    def __init__(self, allowed_local_media_path: str | None = None, *,
                 allowed_media_domains: Iterable[str] | None = None,
                 max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
                 max_bytes: int = DEFAULT_MAX_IMAGE_BYTES):
        self.allowed_root = None
        if allowed_local_media_path:
            root = Path(allowed_local_media_path).expanduser()
            if not root.is_dir():
                raise ValueError(f"allowed_local_media_path {allowed_local_media_path!r} is not a directory")
            self.allowed_root = root.resolve()
        self.url_policy = UrlPolicy(allowed_media_domains)
        check_positive("max_image_pixels", max_image_pixels, optional=False)
        self.max_image_pixels = max_image_pixels
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes

    def load_image(self, url: str) -> Any:
        """-> a decoded PIL image (RGB conversion is the image processor's job)."""
        if not isinstance(url, str) or not url:
            raise ValueError("an image URL must be a non-empty string")
        return decode_image(self._bytes(url), self.max_image_pixels)

    def _bytes(self, url: str) -> bytes:
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme == "data":
            return data_url_bytes(url, self.max_bytes)
        if scheme == "file":
            return self._local_bytes(url)
        if scheme in ("http", "https"):
            return fetch(url, self.url_policy, self.timeout_s, self.max_bytes)
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


def data_url_bytes(url: str, max_bytes: int) -> bytes:
    """A data: URL's payload, at most max_bytes once decoded (the encoded length is checked before decoding)."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise ValueError("a data URL needs a ',' before its payload")
    media_type = header[len("data:"):].split(";")[0].lower()
    if media_type and not media_type.startswith("image/"):
        raise ValueError(f"a data URL of type {media_type!r} is not an image")
    base64_encoded = header.lower().endswith(";base64")
    # base64 takes 4 characters per 3 bytes; percent-encoding at least 1 character per byte, at most 3
    max_encoded = 4 * ((max_bytes + 2) // 3) if base64_encoded else 3 * max_bytes
    if len(payload) > max_encoded:
        raise ValueError(f"the data URL's image is larger than {max_bytes} bytes")
    data = _base64_bytes(payload) if base64_encoded else urllib.parse.unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise ValueError(f"the data URL's image is larger than {max_bytes} bytes")
    return data


def _base64_bytes(payload: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the data URL's base64 payload is invalid") from None


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Any:
    """Image file bytes -> a loaded PIL image of at most max_pixels pixels, checked from the header before the
    pixels are decoded; ValueError for anything larger or anything PIL cannot decode."""
    from PIL import Image

    try:
        with warnings.catch_warnings():  # PIL's own decompression-bomb warning refuses the image too
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # reads the header only
            _check_pixels(image.width, image.height, max_pixels)
            image.load()
        return image
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise _bomb_error(max_pixels, Image.MAX_IMAGE_PIXELS) from None
    except ValueError:
        raise
    except Exception as error:  # UnidentifiedImageError, truncated files, decoder errors
        raise ValueError(f"could not decode the image: {error}") from None


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        raise ValueError(f"the image is {width}x{height} = {width * height} pixels, over the limit of {max_pixels} "
                         "(max_image_pixels, --max-image-pixels)")


def _bomb_error(max_pixels: int, pil_max_pixels: int | None) -> ValueError:
    """PIL refused the image from its header (over its own MAX_IMAGE_PIXELS, as warning or error)."""
    if pil_max_pixels is None or max_pixels < pil_max_pixels:
        return ValueError(f"the image is over the limit of {max_pixels} pixels (max_image_pixels, "
                          "--max-image-pixels)")
    return ValueError(f"the image is over PIL's decompression-bomb limit of {pil_max_pixels} pixels, which "
                      "max_image_pixels (--max-image-pixels) does not raise")
