"""The prompts of `jvllm bench`: random token ids, a ShareGPT-style JSON file, or shared prefixes with random
suffixes (vLLM's dataset names and flags)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

DATASETS = ("random", "sharegpt", "prefix-repetition")


@dataclasses.dataclass
class BenchRequest:
    prompt_ids: list[int]
    output_len: int


def add_dataset_flags(parser: Any, seed_flag: bool = True) -> None:
    """The dataset flags; `seed_flag` False where the engine's own --seed seeds the prompts too."""
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset-name", choices=DATASETS, default="random",
                       help="random: --input-len random token ids; sharegpt: the first human turn of each "
                            "conversation in --dataset-path (a ShareGPT-style JSON list), its reply's length as the "
                            "output length unless --output-len is given; prefix-repetition: --prefix-repetition-"
                            "num-prefixes shared prefixes, each prompt one of them plus a random suffix")
    group.add_argument("--dataset-path", default=None, help="the JSON file of --dataset-name sharegpt")
    group.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    group.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=128,
                       help="prompt tokens of the random dataset (default 128)")
    group.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=None,
                       help="tokens to generate per request (default 128; sharegpt: each reply's length)")
    group.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    group.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    group.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    if seed_flag:
        group.add_argument("--seed", type=int, default=0, help="seed of the random prompts and arrivals")


def build_requests(args: Any, tokenizer: Any, vocab_size: int) -> list[BenchRequest]:
    """The requests `args` describe; token ids are drawn from [100, vocab_size - 100) (clear of special tokens)."""
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    rng = np.random.default_rng(args.seed)
    output_len = args.output_len or 128

    def random_ids(count: int) -> list[int]:
        return rng.integers(100, max(vocab_size - 100, 101), size=count).tolist()

    if args.dataset_name == "random":
        return [BenchRequest(random_ids(args.input_len), output_len) for _ in range(args.num_prompts)]
    if args.dataset_name == "prefix-repetition":
        prefixes = [random_ids(args.prefix_repetition_prefix_len) for _ in range(args.prefix_repetition_num_prefixes)]
        return [BenchRequest(prefixes[i % len(prefixes)] + random_ids(args.prefix_repetition_suffix_len), output_len)
                for i in range(args.num_prompts)]
    return _sharegpt(args, tokenizer)


def _sharegpt(args: Any, tokenizer: Any) -> list[BenchRequest]:
    if not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json")
    with open(args.dataset_path) as f:
        entries = json.load(f)
    requests = []
    for entry in entries if isinstance(entries, list) else []:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, reply = (turn.get("value") if isinstance(turn, dict) else None for turn in turns[:2])
        if not isinstance(prompt, str) or not isinstance(reply, str):
            continue
        prompt_ids = tokenizer.encode(prompt)
        output_len = args.output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if len(prompt_ids) >= 4 and output_len >= 4:  # vLLM's filter: too-short conversations are skipped
            requests.append(BenchRequest(prompt_ids, output_len))
        if len(requests) == args.num_prompts:
            break
    if not requests:
        raise ValueError(f"{args.dataset_path}: no usable conversations (a JSON list of "
                         '{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]})')
    return requests
