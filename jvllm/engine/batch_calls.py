"""The Engine's batch calls, as vLLM's LLM has them: generate and chat, which queue their prompts and step the engine
until every one of them has finished."""
from __future__ import annotations

import itertools
from typing import Any, Sequence

from jvllm.collector import young_collections_spaced
from jvllm.engine.progress import GenerateProgress
from jvllm.engine.prompts import PromptType, conversation_prompts
from jvllm.outputs import RequestOutput
from jvllm.sampling_params import SamplingParams


class BatchCalls:
    """Mixed into Engine: needs its request API (`add_request`, `abort_request`, `_step`, `has_unfinished_requests`,
    `get_default_sampling_params`), `tokenizer`, `model`, `media` and the request counter `_counter`."""

    tokenizer: Any
    model: Any
    media: Any
    _counter: itertools.count

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in input order. `priority`: one per prompt
        (lower runs first), with scheduling_policy='priority'."""
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if not prompt_list:
            raise ValueError("generate() needs at least one prompt")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts")
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        request_ids: list[str] = []
        try:
            for prompt, params, rank in zip(prompt_list, params_list, priorities):
                request_id = f"gen-{next(self._counter)}"
                self.add_request(request_id, prompt, params, priority=rank)
                request_ids.append(request_id)
        except Exception:
            self.abort_request(request_ids)  # all or nothing: a bad prompt leaves no orphans behind
            raise
        return self._run_until_done(request_ids, use_tqdm)

    def _run_until_done(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        with young_collections_spaced():
            return self._step_until_done(request_ids, use_tqdm)

    def _step_until_done(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        finals: dict[str, RequestOutput] = {}
        progress = GenerateProgress(len(request_ids), enabled=use_tqdm)
        try:
            while len(finals) < len(wanted):
                outputs = self._step(finished_only=True)
                if not outputs and not self.has_unfinished_requests():
                    raise RuntimeError("the engine stopped with requests still pending")
                for output in outputs:
                    if output.request_id in wanted:
                        progress.update(output)
                        if output.finished:
                            finals[output.request_id] = output
        except BaseException:
            self.abort_request([rid for rid in request_ids if rid not in finals])
            raise
        finally:
            progress.close()
        return [finals[rid] for rid in request_ids]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate. Message contents
        may be lists of content parts: text, and for vision-language models images (`image_url` with a data:,
        file: or http(s): URL, or `image_pil` with a PIL image). As in vLLM: `continue_final_message` goes on with
        the last (assistant) message instead of starting a new turn; `tools` (OpenAI tool definitions) and
        `chat_template_kwargs` (e.g. {"enable_thinking": False}) are passed to the template; the tool calls in the
        output are text (the server parses them)."""
        if not messages:
            raise ValueError("chat() needs at least one message")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        image_token = None if self.model.vision is None else self.model.vision.image_token
        prompts = conversation_prompts(self.tokenizer, conversations, image_token, self.media.load_image,
                                       chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, tools=tools,
                                       chat_template_kwargs=chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

