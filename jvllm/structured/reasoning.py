"""The reasoning parsers: where a reasoning model's thinking ends, so that a grammar applies to what follows."""
from __future__ import annotations

# What ends the reasoning of each --reasoning-parser: the grammar applies to the text after it.
REASONING_ENDS = {"deepseek_r1": "</think>", "qwen3": "</think>"}
THINK_START = "<think>"


def reasoning_open(parser: str, prompt_tail: str) -> bool:
    """Whether the reply starts inside a thinking block: the prompt's chat template opened one and did not close
    it, or (deepseek_r1, which always thinks first) the prompt shows neither tag."""
    start, end = prompt_tail.rfind(THINK_START), prompt_tail.rfind(REASONING_ENDS[parser])
    if start != end:
        return start > end
    return parser == "deepseek_r1"
