"""What the front ends (AsyncEngine, the HTTP server) read of an Engine: queue and cache figures, image handling,
embedding options; so that none of them reaches into the scheduler, the pages or the processors."""
from __future__ import annotations

from typing import Any, Sequence

from jvllm.engine.status import EngineStats
from jvllm.multimodal.inputs import ProcessedImage, text_only_error
from jvllm.sampling_params import SamplingParams


class FrontEndViews:
    """Mixed into Engine, which sets `scheduler`, `tokenizer`, `encoder_cache`, `pages`, `config`, `model`,
    `mm_processor`, `media`, `embedder`, `default_sampling`."""

    scheduler: Any
    tokenizer: Any
    encoder_cache: Any
    pages: Any
    config: Any
    model: Any
    mm_processor: Any
    media: Any
    embedder: Any
    default_sampling: dict[str, Any]  # SamplingParams keywords from the model's generation config

    def stats(self, num_steps: int = 0) -> EngineStats:
        """The scheduler's queues, the KV pool's use and the prefix cache's counts now (`num_steps`: the caller's)."""
        scheduler = self.scheduler
        drafter = getattr(self, "drafter", None)
        spec = {} if drafter is None else dict(
            spec_decode_num_drafts=drafter.stats.num_drafts, spec_decode_num_draft_tokens=drafter.stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=drafter.stats.num_accepted_tokens,
            spec_decode_accepted_per_position=tuple(drafter.stats.accepted_per_position))
        return EngineStats(num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
                           kv_cache_usage=self.pages.usage, num_preemptions=scheduler.num_preemptions,
                           prefix_cache_queries=getattr(scheduler, "prefix_cache_queries", 0),
                           prefix_cache_hits=getattr(scheduler, "prefix_cache_hits", 0), num_steps=num_steps, **spec)

    def num_waiting_past_capacity(self) -> int:
        """Sequences waiting beyond those the next step can still admit (may be negative: room left)."""
        scheduler = self.scheduler
        return len(scheduler.waiting) - max(self.config.max_num_seqs - len(scheduler.running), 0)

    @property
    def served_model_name(self) -> str:
        return self.model.served_name

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults (temperature, top_p, ...), as vLLM's; what
        generate() and chat() run without sampling_params."""
        return SamplingParams(**self.default_sampling)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def reset_mm_cache(self) -> None:
        """Forget every encoded image that no running request still reads (vLLM's name)."""
        if self.encoder_cache is not None:
            self.encoder_cache.reset()

    def running_request_ids(self) -> set[str]:
        """The ids (as given to add_request) of the requests in the running batch."""
        return {request.group_id for request in self.scheduler.running}

    @property
    def image_token(self) -> str | None:
        """The text that stands for one image in a chat prompt (None: a text-only model)."""
        vision = self.model.vision
        return None if vision is None else vision.image_token

    def load_images(self, urls: Sequence[str]) -> list[ProcessedImage]:
        """Load (data:, file:, http(s) under the engine's media rules) and preprocess a prompt's images; ValueError
        for a text-only model, too many images, or an image refused or unreadable. Blocking: run it off the loop."""
        if self.mm_processor is None:
            raise text_only_error(self.model.served_name)
        self.mm_processor.check_count(len(urls))
        return [self.mm_processor.process_image(self.media.load_image(url)) for url in urls]

    def expand_image_tokens(self, token_ids: list[int], images: list[ProcessedImage]) -> list[int]:
        """Prompt ids with each image placeholder expanded to its image's tokens (ValueError if they disagree)."""
        if self.mm_processor is None:
            raise text_only_error(self.model.served_name)
        return self.mm_processor.expand(token_ids, {"image": images})[0]

    @property
    def supports_dimensions(self) -> bool:
        """Whether embed(dimensions=...) may shorten this model's embeddings (matryoshka)."""
        return self.embedder is not None and self.embedder.supports_dimensions
