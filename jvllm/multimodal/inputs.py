"""A prompt's images to multimodal items: validated, preprocessed by the model's image processor, hashed, and their
placeholder tokens expanded to the model's image token count (as transformers' LlavaProcessor does)."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import xxhash

from jvllm.core.encoder_cache import ENCODER_BLOCK_ROWS, EncoderCache, MultiModalItem, encoder_cache_rows
from jvllm.multimodal.media import DEFAULT_MAX_IMAGE_PIXELS, MediaLoader

MODALITIES = ("image",)
DEFAULT_LIMIT_PER_PROMPT = 999  # vLLM's default per modality


def parse_limits(limits: dict[str, int] | None) -> dict[str, int]:
    """`limit_mm_per_prompt` ({"image": N}) checked; modalities not given take the default."""
    result = {modality: DEFAULT_LIMIT_PER_PROMPT for modality in MODALITIES}
    for modality, limit in (limits or {}).items():
        if modality not in MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: unsupported modality {modality!r}; supported: "
                             f"{', '.join(MODALITIES)}")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be an integer >= 0, got {limit!r}")
        result[modality] = limit
    return result


def content_hash(pixel_values: np.ndarray) -> int:
    """64-bit xxh3 of a preprocessed input's bytes, shape and dtype: equal inputs, equal hashes."""
    array = np.ascontiguousarray(pixel_values)
    digest = xxhash.xxh3_64(array.tobytes())
    digest.update(repr((array.shape, array.dtype.str)).encode())
    return digest.intdigest()


@dataclasses.dataclass(frozen=True)
class ProcessedImage:
    """An image already through the model's image processor (MultiModalProcessor.process_image), so a server can
    preprocess off the engine's thread; multi_modal_data["image"] takes these beside PIL images."""

    pixel_values: np.ndarray  # the encoder's input: [C, H, W] (LLaVA) or flattened patches [P, patch_dim] (Qwen2-VL)
    hash: int
    num_tokens: int  # the placeholder tokens it fills in a prompt
    grid: tuple[int, int] | None = None  # those tokens' (rows, columns) for M-RoPE models


def as_image_list(data: Any) -> list[Any]:
    """multi_modal_data["image"]: one image or a list of them."""
    return list(data) if isinstance(data, (list, tuple)) else [data]


def as_pil_image(image: Any) -> Any:
    """A PIL image (loaded) from a PIL image or an HWC uint8 array; ValueError for anything else."""
    from PIL import Image

    if isinstance(image, np.ndarray):
        try:
            image = Image.fromarray(image)
        except (TypeError, ValueError) as error:
            raise ValueError(f"unsupported image array ({image.dtype}, shape {image.shape}): {error}") from None
    if not isinstance(image, Image.Image):
        raise ValueError(f"an image must be a PIL.Image or a numpy array, got {type(image).__name__}")
    return image


def run_image_processor(processor: Any, image: Any, **kwargs: Any) -> dict[str, np.ndarray]:
    """The processor's numpy outputs for one image; ValueError if it cannot read it."""
    image = as_pil_image(image)
    try:
        image.load()
        return dict(processor(images=[image], return_tensors="np", **kwargs))
    except Exception as error:  # PIL and the processor raise many kinds for unreadable or odd images
        raise ValueError(f"could not process the image ({image.mode}, {image.size}): {error}") from None


class MultiModalProcessor:
    """Turns `multi_modal_data` into the request's items for one vision-language model."""

    def __init__(self, vision: Any, limits: dict[str, int] | None = None):
        """`vision`: a jvllm.model_loader.vision.VisionModel."""
        self.vision = vision
        self.limits = parse_limits(limits)
        self.image_token_id = vision.image_token_id
        self.tokens_per_image = vision.tokens_per_image  # None: it depends on the image's size
        self.max_image_tokens = vision.max_image_tokens

    def preprocess(self, image: Any) -> ProcessedImage:
        """One image (PIL, or an HWC uint8 array) through the model's image processor; ValueError if it is not an
        image the processor can read."""
        if self.tokens_per_image is not None:  # LLaVA: resized and cropped to the tower's input
            pixels = np.asarray(run_image_processor(self.vision.image_processor, image)["pixel_values"][0], np.float32)
            return self._checked(ProcessedImage(pixels, content_hash(pixels), self.tokens_per_image))
        # Qwen2-VL: resized to a multiple of the merged patch size, within the processor's pixel bounds
        out = run_image_processor(self.vision.image_processor, image, **self.vision.processor_kwargs)
        patches = np.asarray(out["pixel_values"], np.float32)  # [P, patch_dim]
        _, rows, cols = (int(n) for n in out["image_grid_thw"][0])  # in patches
        merge = self.vision.config.vision.spatial_merge_size
        grid = (rows // merge, cols // merge)
        return self._checked(ProcessedImage(patches, content_hash(patches), grid[0] * grid[1], grid))

    def _checked(self, image: ProcessedImage) -> ProcessedImage:
        """A processed image whose input shape and token count this model's encoder takes."""
        shape, want = image.pixel_values.shape, self.vision.input_shape(image.num_tokens)
        if shape != want:
            raise ValueError(f"processed pixel values of shape {shape}; the vision encoder takes {want} for an "
                             f"image of {image.num_tokens} tokens")
        if image.num_tokens > self.max_image_tokens:
            raise ValueError(f"the image needs {image.num_tokens} tokens; this engine encodes images of at most "
                             f"{self.max_image_tokens}")
        return image

    def process_image(self, image: Any) -> ProcessedImage:
        """Preprocess and hash one image (a ProcessedImage is checked and passes through)."""
        return self._checked(image) if isinstance(image, ProcessedImage) else self.preprocess(image)

    def check_count(self, num_images: int) -> None:
        limit = self.limits["image"]
        if num_images > limit:
            raise ValueError(f"the prompt has {num_images} images but limit_mm_per_prompt allows {limit} per prompt")

    def expand(self, token_ids: list[int],
               multi_modal_data: dict[str, Any] | None) -> tuple[list[int], list[MultiModalItem]]:
        """Prompt ids with each image placeholder expanded (a single placeholder token per image, or an already
        expanded run of the image's token count) -> (ids, one item per image in prompt order)."""
        data = dict(multi_modal_data or {})
        unknown = sorted(set(data) - set(MODALITIES))
        if unknown:
            raise ValueError(f"multi_modal_data: unsupported modality {unknown[0]!r}; supported: "
                             f"{', '.join(MODALITIES)}")
        images = as_image_list(data["image"]) if data.get("image") is not None else []
        self.check_count(len(images))
        runs = self._placeholder_runs(token_ids)
        if len(runs) != len(images):
            raise ValueError(f"the prompt has {len(runs)} image placeholder(s) ({self.vision.image_token}) but "
                             f"{len(images)} image(s) were given")
        processed = [self.process_image(image) for image in images]
        expanded: list[int] = []
        items: list[MultiModalItem] = []
        cursor = 0
        for (start, length), image in zip(runs, processed):
            if length not in (1, image.num_tokens):
                raise ValueError(f"a run of {length} image tokens: each image takes one placeholder "
                                 f"({self.vision.image_token}) or exactly its {image.num_tokens} tokens")
            expanded += token_ids[cursor:start]
            items.append(MultiModalItem("image", image.hash, len(expanded), image.num_tokens, image.pixel_values,
                                        image.grid))
            expanded += [self.image_token_id] * image.num_tokens
            cursor = start + length
        return expanded + token_ids[cursor:], items

    def _placeholder_runs(self, token_ids: list[int]) -> list[tuple[int, int]]:
        """(start, length) of each image's placeholder: one image token (to expand) or an already expanded run.
        With a fixed token count n (LLaVA), adjacent placeholders form one run: k < n tokens are k images, a
        multiple of n that many expanded images; otherwise (Qwen2-VL, whose images sit between vision-start and
        vision-end tokens) each run is one image."""
        n = self.tokens_per_image
        runs: list[tuple[int, int]] = []
        index = 0
        while index < len(token_ids):
            if token_ids[index] != self.image_token_id:
                index += 1
                continue
            end = index
            while end < len(token_ids) and token_ids[end] == self.image_token_id:
                end += 1
            length = end - index
            if n is None:
                runs.append((index, length))
            elif length % n == 0:
                runs += [(start, n) for start in range(index, end, n)]
            elif length < n:
                runs += [(start, 1) for start in range(index, end)]
            else:
                raise ValueError(f"a run of {length} image tokens: each image takes one placeholder "
                                 f"({self.vision.image_token}) or exactly {n} tokens")
            index = end
        return runs


class PromptImages:
    """One prompt's images on their way into a request: `expand` (tokenize_prompt's hook) expands the placeholders
    and keeps the items."""

    def __init__(self, processor: MultiModalProcessor | None, prompt: Any, model_name: str):
        self.data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if processor is None and self.data:
            raise text_only_error(model_name)
        self.processor = processor
        self.items: list[MultiModalItem] = []

    def expand(self, token_ids: list[int]) -> list[int]:
        if self.processor is None:
            return token_ids
        token_ids, self.items = self.processor.expand(token_ids, self.data)
        return token_ids


def engine_multimodal(loaded: Any, max_num_batched_tokens: int, limits: dict[str, int] | None,
                      allowed_local_media_path: str | None, encoder_cache_tokens: int | None, *,
                      allowed_media_domains: list[str] | None = None,
                      max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
                      ) -> tuple[EncoderCache | None, MultiModalProcessor | None, MediaLoader]:
    """An engine's multimodal parts: the encoder cache and the prompt processor (vision-language models only),
    and the media loader. Limits are checked for every model."""
    parse_limits(limits)
    media = MediaLoader(allowed_local_media_path, allowed_media_domains=allowed_media_domains,
                        max_image_pixels=max_image_pixels)
    vision = loaded.vision
    if vision is None:
        return None, None, media
    rows = encoder_cache_rows(vision.max_image_tokens, max_num_batched_tokens, encoder_cache_tokens)
    return EncoderCache(rows, ENCODER_BLOCK_ROWS), MultiModalProcessor(vision, limits), media


def text_only_error(model_name: str) -> ValueError:
    return ValueError(f"model {model_name!r} is a text-only model: it takes no images (multi_modal_data, "
                      "image content parts)")
