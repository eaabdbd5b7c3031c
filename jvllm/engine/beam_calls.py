"""The Engine's beam search, as vLLM's LLM.beam_search: every prompt's live beams extended together, a round a call."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from tqdm.auto import tqdm

from jvllm.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from jvllm.engine.prompts import PromptType, tokenize_prompt
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import SamplingParams


class BeamSearchCalls:
    """Mixed into Engine: needs its `generate`, `tokenizer`, `eos_token_ids`, `model` and `config`."""

    tokenizer: Any
    model: Any
    config: Any
    eos_token_ids: list[int]
    generate: Callable[..., list[RequestOutput]]

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, *,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """The beam_width best continuations of each prompt (str, {'prompt': str} or {'prompt_token_ids': [...]}),
        best first, in input order. A beam stops at EOS (unless params.ignore_eos), after max_tokens tokens, or
        where the model's max_model_len ends it."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"beam_search takes BeamSearchParams, got {type(params).__name__}")
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if not prompts:
            raise ValueError("beam_search() needs at least one prompt")
        max_len = self.config.max_model_len
        searches = []
        for prompt in prompts:
            if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
                raise ValueError("beam search does not take images")
            _, token_ids = tokenize_prompt(self.tokenizer, prompt, self.model.config.vocab_size, max_len)
            searches.append(BeamSearch(token_ids, params, self.eos_token_ids, max_len))
        round_params = params.round_params()
        with tqdm(total=params.max_tokens, desc="Beam search", unit="token", disable=not use_tqdm) as progress:
            while not all(search.done for search in searches):
                self._beam_round([s for s in searches if not s.done], round_params)
                progress.update(1)
        outputs = []
        for search in searches:
            best = search.best()
            for beam in best:
                beam.text = self.tokenizer.decode(beam.tokens)
            outputs.append(BeamSearchOutput(best))
        return outputs

    def _beam_round(self, searches: list[BeamSearch], round_params: SamplingParams) -> None:
        """Every live beam of `searches` one token further, in one generate call."""
        beams = [beam for search in searches for beam in search.live]
        results = iter(self.generate([{"prompt_token_ids": beam.tokens} for beam in beams], round_params,
                                     use_tqdm=False))
        for search in searches:
            search.advance([next(results) for _ in search.live])
