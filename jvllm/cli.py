"""The `jvllm` command line: `jvllm generate PROMPT` (serve, chat and bench arrive with later issues)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time


def human_int(text: str) -> int:
    """Integer flags accept 1k / 32K / 1m (binary multiples for k and m, as vLLM does)."""
    value = text.strip().lower()
    multipliers = {"k": 1024, "m": 1024 * 1024}
    try:
        if value and value[-1] in multipliers:
            return int(float(value[:-1]) * multipliers[value[-1]])
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer like 512, 4k or 32K, got {text!r}") from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="HF folder with config.json, a .gguf file, or a known name "
                            "(default: the embedded SmolLM2-135M-Instruct)")
    group.add_argument("--tokenizer", default=None, help="tokenizer folder if not the model's own")
    group.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16")
    group.add_argument("--max-model-len", type=human_int, default=None, help="context limit (prompt + output)")
    group.add_argument("--max-num-seqs", type=human_int, default=None, help="sequences per step")
    group.add_argument("--max-num-batched-tokens", type=human_int, default=None, help="tokens per step")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    group.add_argument("--kv-cache-memory-bytes", type=human_int, default=None, help="KV pool size in bytes")
    group.add_argument("--attention-backend", default="auto", help="auto, xla or pallas")
    group.add_argument("--load-format", default="auto", help="auto, safetensors, gguf or dummy (random weights)")
    group.add_argument("--seed", type=int, default=0, help="engine seed for unseeded requests")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                attention_backend=args.attention_backend, load_format=args.load_format, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jvllm", description="jvllm: JAX/XLA LLM inference with vLLM's API")
    parser.add_argument("--version", action="version", version=f"jvllm {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = commands.add_parser("generate", help="generate a completion for one prompt and print it",
                              description="Generate a completion for PROMPT with the default or given model.")
    gen.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--max-tokens", type=human_int, default=128, help="tokens to generate (default 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="0 disables")
    gen.add_argument("--request-seed", "--sampling-seed", dest="request_seed", type=int, default=None,
                     help="per-request sampling seed")
    gen.add_argument("-v", "--verbose", action="store_true", help="log engine progress and timings")
    add_engine_args(gen)
    return parser


def _version() -> str:
    from jvllm import __version__

    return __version__


def run_generate(args: argparse.Namespace) -> int:
    from jvllm import Engine, SamplingParams

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    started = time.perf_counter()
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.request_seed)
        engine = Engine(**engine_kwargs(args))
        loaded = time.perf_counter()
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            outputs = engine.chat(messages + [{"role": "user", "content": args.prompt}], params, use_tqdm=False)
        else:
            outputs = engine.generate(args.prompt, params, use_tqdm=False)
    except (ValueError, FileNotFoundError) as error:
        print(f"jvllm: error: {error}", file=sys.stderr)
        return 2
    output = outputs[0].outputs[0]
    print(output.text)
    if args.verbose:
        done = time.perf_counter()
        print(f"[start {loaded - started:.1f}s, generate {done - loaded:.1f}s, {len(output.token_ids)} tokens, "
              f"finish_reason={output.finish_reason}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # jvllm never downloads weights at run time
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate":
        return run_generate(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
