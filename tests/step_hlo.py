"""Optimized HLO of the steps a runner would run for a StepCall (for checking collectives and buffers)."""
from __future__ import annotations

from typing import Any

import jax


def compiled_step_hlo(runner: Any, call: Any) -> dict[str, str]:
    """{'forward_sample': HLO text, 'store_kv': HLO text when the backend stores K/V in a jit of its own}."""
    md, ids, positions, sampling, targets = runner._device_inputs(call)
    rows = call.input_ids.shape[0]
    step = runner.steps.forward_sample.lower(
        runner.step_weights.for_rows(rows), runner.kv_cache, ids, positions, md, sampling, targets,
        flags=call.flags, num_logprobs=call.num_logprobs, num_prompt_logprobs=call.num_prompt_logprobs)
    texts = {"forward_sample": step.compile().as_text()}
    store = runner.steps.store_kv
    if hasattr(store, "lower"):
        _, layer_results = jax.eval_shape(
            lambda *args: runner.steps.forward_sample(*args, flags=call.flags, num_logprobs=call.num_logprobs,
                                                      num_prompt_logprobs=call.num_prompt_logprobs),
            runner.step_weights.for_rows(rows), runner.kv_cache, ids, positions, md, sampling, targets)
        texts["store_kv"] = store.lower(runner.kv_cache, layer_results, md).compile().as_text()
    return texts
