"""Prompt sets of the benchmarks: fixed-length random ids, a long-tailed varied mix, uneven chat prompts, and long
documents to summarize."""
from __future__ import annotations

import dataclasses

import numpy as np

TOPICS = ["tides", "lighthouses", "bread", "volcanoes", "bees", "glaciers", "trains", "coral reefs", "maps",
          "clocks", "owls", "deserts", "bridges", "tea", "comets", "rivers", "wind", "paper", "salt", "moss"]
ASKS = ["Explain how {t} work to a curious child, in a few friendly sentences.",
        "Write a short poem about {t}, with a surprising last line.",
        "Give three little-known facts about {t} and say why each one matters to people today.",
        "I am preparing a class on {t}. Suggest an outline with an opening question, two activities and a "
        "closing summary that students will remember.",
        "Compare {t} and {u}: what do they have in common, and what sets them apart?",
        "My friend says {t} are overrated. Write a polite reply that changes their mind, using an example from "
        "history and one from daily life, and end with a question for them.",
        "Describe a day in the life of someone who studies {t} for a living."]


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]  # token ids
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def input_tokens(self) -> int:
        return sum(map(len, self.prompts))


def fixed(num: int, input_len: int, output_len: int, vocab: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    return Workload([rng.integers(100, vocab - 100, size=input_len).tolist() for _ in range(num)],
                    [output_len] * num)


def _long_tailed(rng: np.random.Generator, num: int, low: int, high: int, total: int) -> list[int]:
    """`num` log-normal lengths in [low, high] summing to `total` (within rounding)."""
    raw = rng.lognormal(mean=0.0, sigma=1.0, size=num)
    lengths = np.clip(raw * total / raw.sum(), low, high)
    for _ in range(20):  # clipping moved the sum: rescale the unclipped ones
        free = (lengths > low) & (lengths < high)
        if not free.any():
            break
        lengths[free] *= (total - lengths[~free].sum()) / lengths[free].sum()
        lengths = np.clip(lengths, low, high)
    return [int(round(x)) for x in lengths]


def varied(num: int, input_tokens: int, output_tokens: int, vocab: int, seed: int) -> Workload:
    """Prompts of 16-1,024 tokens and outputs of 16-256, log-normal, with the given totals."""
    rng = np.random.default_rng(seed)
    input_lens = _long_tailed(rng, num, 16, 1024, input_tokens)
    output_lens = _long_tailed(rng, num, 16, 256, output_tokens)
    return Workload([rng.integers(100, vocab - 100, size=n).tolist() for n in input_lens], output_lens)


def chat_varied(tokenizer, num: int, output_tokens: int, seed: int) -> Workload:
    """`chat` prompts with long-tailed output lengths (16-256, `output_tokens` in all): the batch thins out to a
    few long answers at its end."""
    prompts = chat(tokenizer, num, 0, seed).prompts
    return Workload(prompts, _long_tailed(np.random.default_rng(seed), num, 16, 256, output_tokens))


def chat_messages(num: int, seed: int) -> list[list[dict]]:
    """`num` single-turn chats of uneven length, drawn from the topics and asks above."""
    rng = np.random.default_rng(seed)
    chats = []
    for _ in range(num):
        t, u = rng.choice(TOPICS, size=2, replace=False)
        ask = ASKS[int(rng.integers(len(ASKS)))].format(t=t, u=u)
        chats.append([{"role": "user", "content": ask}])
    return chats


def chat(tokenizer, num: int, output_len: int, seed: int) -> Workload:
    """Chat prompts rendered with the model's template (generation prompt added), as token ids."""
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
               for m in chat_messages(num, seed)]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    return Workload(prompts, [output_len] * num)


def long_document(chars: int, seed: int) -> str:
    """About `chars` characters of notes (sentences drawn from the topics and asks above, from the first one on
    different for each seed), then a request to summarize them: a long single-stream prompt as plain text."""
    rng = np.random.default_rng(seed)
    parts: list[str] = []
    length = 0
    while length < chars:
        t, u = rng.choice(TOPICS, size=2, replace=False)
        sentence = f"Note {len(parts) + 1} ({seed}): " + ASKS[int(rng.integers(len(ASKS)))].format(t=t, u=u)
        parts.append(sentence)
        length += len(sentence) + 1
    return "\n".join(parts) + "\n\nSummarize the notes above in one paragraph."
