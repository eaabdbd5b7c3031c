"""The draft model of speculative decoding (method "draft_model"): an engine of its own that continues each
speculating sequence greedily, reusing its KV pages from one step to the next through prefix caching."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from jvllm.config import EngineConfig
from jvllm.engine.arg_utils import EngineArgs
from jvllm.sampling_params import SamplingParams
from jvllm.spec_decode.config import SpeculativeConfig

logger = logging.getLogger("jvllm")


class DraftModelRunner:
    """Greedy continuations of token sequences by the draft model (jvllm.spec_decode.drafter.DraftModel).

    Each call is one `generate` of the draft engine: a sequence's full pages computed by an earlier call come from
    the draft engine's prefix cache, so a call computes the sequence from its first page not found there (its last,
    partial page, or the page where the earlier call's drafts part from the accepted tokens), then one token a step.
    The draft engine has its own KV pool and its own closed set of step shapes (at most max_batch_size sequences a
    step), compiled at start."""

    def __init__(self, engine: Any, num_speculative_tokens: int):
        self.engine = engine
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_size: int = engine.model.config.vocab_size
        self.max_model_len: int = engine.config.max_model_len
        self._warned = False

    @classmethod
    def start(cls, target: EngineArgs, target_config: EngineConfig, target_tokenizer: Any,
              speculative: SpeculativeConfig, multi_host: bool) -> "DraftModelRunner":
        """Load the draft model with the target's dtype, load format, pool budget and limits (the target's
        `precompile` compiles its steps too); ValueError when its vocabulary is not the target's."""
        from jvllm.engine.llm import Engine  # the engine module builds this runner

        if multi_host:
            raise ValueError("speculative_config method draft_model runs on one host; use ngram or suffix with "
                             "num_hosts > 1")
        args = dataclasses.replace(
            target, model=speculative.model, tokenizer=None, served_model_name=None, quantization=None,
            max_model_len=target_config.max_model_len, max_num_seqs=speculative.max_batch_size,
            max_num_batched_tokens=target_config.max_num_batched_tokens, enable_prefix_caching=True,
            precompile=False, speculative_config=None, pooling=None, normalize=None, limit_mm_per_prompt=None,
            mm_processor_kwargs=None)
        logger.info("loading the draft model %s", speculative.model)
        try:
            engine = Engine.from_engine_args(args)
        except ValueError as error:
            raise ValueError(f"speculative_config draft model {speculative.model!r}: {error}") from None
        if engine.runner is None:
            raise ValueError(f"speculative_config draft model {speculative.model!r} is an embedding model; a draft "
                             "model generates")
        if engine.tokenizer.get_vocab() != target_tokenizer.get_vocab():
            raise ValueError(f"speculative_config draft model {speculative.model!r} has another vocabulary than the "
                             "target model; a draft model must share the target's tokenizer")
        return cls(engine, speculative.num_speculative_tokens)

    def precompile(self, *, max_step_tokens: int | None, max_rows: int | None) -> None:
        """Compile the draft engine's step shapes; bounded as the target's are (Engine.precompile), where a sequence
        can also recompute a page and the drafts its previous call computed past its accepted tokens."""
        if max_step_tokens is not None:
            max_step_tokens += self.engine.config.page_size + self.num_speculative_tokens
        self.engine.precompile(max_step_tokens=max_step_tokens, max_rows=max_rows)

    def continuations(self, sequences: list[list[int]], limits: list[int]) -> list[list[int]]:
        """Up to limits[i] greedy next tokens of each sequence ([] for a sequence the draft model cannot continue:
        a token outside its vocabulary, or no room left in its context)."""
        runnable = [index for index, (tokens, limit) in enumerate(zip(sequences, limits))
                    if max(tokens) < self.vocab_size and len(tokens) + limit <= self.max_model_len]
        found: list[list[int]] = [[] for _ in sequences]
        if not runnable:
            return found
        prompts = [{"prompt_token_ids": sequences[index]} for index in runnable]
        params = [SamplingParams(temperature=0.0, max_tokens=limits[index], skip_special_tokens=False)
                  for index in runnable]
        try:
            outputs = self.engine.generate(prompts, params, use_tqdm=False)
        except ValueError as error:  # e.g. a sequence its pool cannot hold: no drafts, the target goes on
            if not self._warned:
                logger.warning("the draft model proposes nothing for this batch: %s", error)
                self._warned = True
            return found
        for index, output in zip(runnable, outputs):
            found[index] = list(output.outputs[0].token_ids)
        return found
