"""The `jvllm` command line: `jvllm generate PROMPT`, `jvllm serve [MODEL]`, `jvllm chat` (bench: later issue)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from server.reasoning import REASONING_PARSERS
from server.tool_parsers import TOOL_PARSERS


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


def json_list(text: str) -> list[str]:
    """CORS flags take a JSON list of strings, e.g. '["https://example.com"]', as vLLM's do."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings like '[\"*\"]', got {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def json_object(text: str, example: str = '{"max_pixels": 802816}') -> dict:
    """A JSON object argument (--mm-processor-kwargs, and --limit-mm-per-prompt below), as vLLM takes them."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object like '{example}', got {text!r}")
    return value


def json_limits(text: str) -> dict[str, int]:
    """--limit-mm-per-prompt takes a JSON object of modality -> count, e.g. '{"image": 4}', as vLLM's does."""
    value = json_object(text, '{"image": 4}')
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
        raise argparse.ArgumentTypeError(f"expected a JSON object of integers, got {text!r}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="HF folder with config.json, a .gguf file, or a known name "
                            "(default: the embedded SmolLM2-135M-Instruct)")
    group.add_argument("--tokenizer", default=None, help="tokenizer folder if not the model's own")
    group.add_argument("--dtype", default="auto", help="auto (float32 on CPU, with a bfloat16 copy for batched steps; "
                            "bfloat16 on GPU; a GGUF model keeps its quantized blocks on CPU), float32 (every step in "
                            "float32, GGUF dequantized), bfloat16")
    group.add_argument("--quantization", default=None, choices=["gguf", "int8", "fp8"],
                       help="gguf: keep a GGUF model's quantized blocks whatever the dtype and backend (by default "
                            "they are kept with --dtype auto on CPU); int8: quantize a float checkpoint's projections "
                            "and embeddings at load (on CPU int8 with a scale per 32 weights, GGUF's Q8_0 layout; on "
                            "GPU int8 with a scale per output channel); fp8 (GPU only): float8_e4m3fn with a scale "
                            "per output channel")
    group.add_argument("--max-model-len", type=human_int, default=None, help="context limit (prompt + output)")
    group.add_argument("--max-num-seqs", type=human_int, default=None, help="sequences per step")
    group.add_argument("--max-num-batched-tokens", type=human_int, default=None, help="tokens per step")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    group.add_argument("--kv-cache-memory-bytes", type=human_int, default=None, help="KV pool size in bytes")
    group.add_argument("--attention-backend", default="auto",
                       help="auto (pallas on GPU, cpu on CPU), cpu (native C++ kernels), xla (plain jnp) or pallas")
    group.add_argument("--load-format", default="auto", help="auto, safetensors, gguf or dummy (random weights)")
    group.add_argument("--seed", type=int, default=0, help="engine seed for unseeded requests")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="devices to shard the model over (tensor parallelism; all hosts' devices together)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the KV pages of shared prompt prefixes (default on)")
    group.add_argument("--batched-weight-dtype", default="auto",
                       help="extra weight copy for steps of 2+ token rows: auto (bfloat16 for a float32 model on CPU "
                            "when --dtype is auto; ~1.6x faster batched steps), none, or a dtype such as bfloat16")
    group.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                       help="what the KV pages hold: auto (the model's dtype; bfloat16 for a GGUF model served from "
                            "its blocks on CPU, like llama.cpp's 16-bit KV cache), bfloat16 or float32")
    group.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=True,
                       help="compile every step shape before serving (default on; loaded from the cache after the "
                            "first start; `generate` compiles only the shapes its one prompt can meet); "
                            "--no-precompile compiles each shape when first used")
    group.add_argument("--limit-mm-per-prompt", type=json_limits, default=None, metavar="JSON",
                       help='images per prompt of a vision-language model, e.g. \'{"image": 4}\' (default 999)')
    group.add_argument("--mm-processor-kwargs", type=json_object, default=None, metavar="JSON",
                       help='image processor settings of a vision-language model, e.g. Qwen2-VL\'s '
                            '\'{"max_pixels": 802816}\' (pixels per image; 28 x 28 pixels make one image token)')
    group.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                       help="folder that file: image URLs may read from (default: none; file: URLs are refused)")
    group.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                       help="the only hosts (names or IP addresses) http(s) image URLs may be fetched from; listed "
                            "hosts may be private or loopback (default: any host, but public addresses only: "
                            "loopback, private, link-local and cloud metadata addresses are refused)")
    group.add_argument("--max-image-pixels", type=human_int, default=4096 * 4096, metavar="N",
                       help="largest decoded image (width x height), checked before decoding (default 16777216, "
                            "4096 x 4096)")


def add_multihost_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-host (one mesh over several processes; run the same command on each)")
    group.add_argument("--num-hosts", type=int, default=None,
                       help="processes in the deployment (default: $JVLLM_NUM_HOSTS, else 1)")
    group.add_argument("--host-rank", type=int, default=None,
                       help="this process's rank, 0 to num-hosts - 1; rank 0 schedules (and serves HTTP), the "
                            "others follow its steps (default: $JVLLM_HOST_RANK, else 0)")
    group.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="rank 0's address for jax.distributed, reachable by every host "
                            "(default: $JVLLM_COORDINATOR)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    multihost = {name: getattr(args, name) for name in ("num_hosts", "host_rank", "coordinator")
                 if getattr(args, name, None) is not None}
    return dict(**multihost, model=args.model, tokenizer=args.tokenizer, dtype=args.dtype,
                quantization=args.quantization, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                attention_backend=args.attention_backend, load_format=args.load_format, seed=args.seed,
                tensor_parallel_size=args.tensor_parallel_size, enable_prefix_caching=args.enable_prefix_caching,
                batched_weight_dtype=args.batched_weight_dtype, kv_cache_dtype=args.kv_cache_dtype,
                precompile=args.precompile,
                limit_mm_per_prompt=args.limit_mm_per_prompt, allowed_local_media_path=args.allowed_local_media_path,
                mm_processor_kwargs=args.mm_processor_kwargs, allowed_media_domains=args.allowed_media_domains,
                max_image_pixels=args.max_image_pixels)


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
    add_multihost_args(gen)
    _add_serve_parser(commands)
    _add_chat_parser(commands)
    return parser


_SERVE_HELP = """\
Serve MODEL over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models, ...), so a
program written for OpenAI or vLLM works by changing only its base URL, e.g.
  jvllm serve --port 8000 --api-key secret
  curl localhost:8000/v1/chat/completions -H 'Authorization: Bearer secret' \\
       -d '{"messages": [{"role": "user", "content": "Hi"}]}'
/health, /version and /metrics (Prometheus) are public; every other route needs the key when one is set.
SIGTERM or Ctrl-C stops accepting connections, lets open requests finish for up to --shutdown-timeout
seconds, aborts the rest and exits 0."""


def _add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server", description=_SERVE_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="model to serve (same as --model; default: the embedded SmolLM2-135M-Instruct)")
    net = serve.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1, this machine "
                                                          "only; 0.0.0.0 exposes the server to the network)")
    net.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    net.add_argument("--api-key", default=os.environ.get("JVLLM_API_KEY"),
                     help="require 'Authorization: Bearer KEY' (default: $JVLLM_API_KEY, else no key)")
    net.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                     help="name(s) clients use in 'model'; the first is reported (default: the model's name)")
    net.add_argument("--max-waiting-requests", type=human_int, default=1024,
                     help="queued requests beyond which new ones get 503 + Retry-After (default 1024)")
    net.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds open requests may run after SIGTERM before they are aborted (default 30)")
    net.add_argument("--chat-template", default=None, help="Jinja chat template (file or text) replacing the "
                                                           "tokenizer's")
    net.add_argument("--max-logprobs", type=int, default=20, help="largest logprobs/top_logprobs allowed (20)")
    net.add_argument("--enable-log-requests", action="store_true",
                     help="log prompts, parameters and outputs (off by default: they may be private)")
    net.add_argument("--disable-access-log", action="store_true", help="no per-request access log lines")
    limits = serve.add_argument_group("admission limits (a request over one is refused with 400/413 before any work)")
    limits.add_argument("--max-n", type=human_int, default=None,
                        help="largest n (completions per prompt) a request may ask (default and maximum: "
                             "--max-num-seqs)")
    limits.add_argument("--max-prompt-chars", type=human_int, default=None,
                        help="longest prompt text in characters, checked before tokenizing (default: max-model-len "
                             "x the longest token's characters, so only prompts that cannot fit are refused)")
    limits.add_argument("--max-request-body-bytes", type=human_int, default=None,
                        help="largest request body; larger ones get 413 (default 32m)")
    limits.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept a `chat_template` in requests (refused by default: a template is code the "
                             "server runs; even trusted ones get a time bound)")
    cors = serve.add_argument_group("CORS (as vLLM's flags; values are JSON lists)")
    cors.add_argument("--allowed-origins", type=json_list, default=["*"], help='allowed origins (default ["*"])')
    cors.add_argument("--allowed-methods", type=json_list, default=["*"], help='allowed methods (default ["*"])')
    cors.add_argument("--allowed-headers", type=json_list, default=["*"], help='allowed headers (default ["*"])')
    cors.add_argument("--allow-credentials", action="store_true", help="allow credentials (cookies, auth headers)")
    tools = serve.add_argument_group("tool calling and reasoning (as vLLM's flags)")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model decide when to call tools (tool_choice "auto", the default when a '
                            "request has tools); needs --tool-call-parser")
    tools.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="the format the model writes tool calls in: hermes (<tool_call>{...}</tool_call>), "
                            "llama3_json ({\"name\": ..., \"parameters\": ...}), mistral ([TOOL_CALLS][...])")
    tools.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                       help="move the model's <think>...</think> text into message.reasoning_content; "
                            "structured outputs apply after it")
    net.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                     help="server log level (default info)")
    add_engine_args(serve)
    add_multihost_args(serve)


_CHAT_HELP = """\
Chat in the terminal; replies stream token by token. Against a running server:
  jvllm chat --url http://localhost:8000/v1 [--api-key KEY]
or, without --url, with an engine loaded in this process (engine flags below). With --url, --model is the
served model name (default: the server's first model). Type a message and press Enter; /clear forgets
the conversation, /exit or Ctrl-D ends the chat."""


def _add_chat_parser(commands: argparse._SubParsersAction) -> None:
    chat = commands.add_parser("chat", help="interactive chat in the terminal (streams tokens)",
                               description=_CHAT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    chat.add_argument("--url", default=None,
                      help="base URL of a running server, e.g. http://localhost:8000/v1 (default: in-process)")
    chat.add_argument("--api-key", default=os.environ.get("JVLLM_API_KEY"), help="key for --url "
                                                                                 "(default: $JVLLM_API_KEY)")
    chat.add_argument("--system", default=None, help="system message that starts the conversation")
    chat.add_argument("--max-tokens", type=human_int, default=512, help="tokens per reply (default 512)")
    chat.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    chat.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    chat.add_argument("-q", "--quick", default=None, metavar="MESSAGE",
                      help="send MESSAGE, print the streamed reply and exit")
    add_engine_args(chat)


def _version() -> str:
    from jvllm import __version__

    return __version__


def run_generate(args: argparse.Namespace) -> int:
    from jvllm import Engine, SamplingParams
    from jvllm.engine.prompts import chat_prompts

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    started = time.perf_counter()
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.request_seed)
        engine = Engine(**{**engine_kwargs(args), "precompile": False})
        if not engine.is_leader:  # multi-host: run rank 0's steps until it is done
            engine.follow()
            return 0
        tokenizer = engine.get_tokenizer()
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            prompt = chat_prompts(tokenizer, [messages + [{"role": "user", "content": args.prompt}]],
                                  chat_template=None, add_generation_prompt=True)[0]
        else:
            prompt = {"prompt": args.prompt, "prompt_token_ids": tokenizer.encode(args.prompt)}
        if args.precompile:  # the one request's steps: its prompt's prefill shapes and one-row decode steps
            engine.precompile(max_step_tokens=len(prompt["prompt_token_ids"]), max_rows=1)
        loaded = time.perf_counter()
        outputs = engine.generate(prompt, params, use_tqdm=False)
        engine.shutdown()  # multi-host: release the followers
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


def run_serve(args: argparse.Namespace) -> int:
    from server.serve import run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    if args.model_tag and args.model and args.model_tag != args.model:
        print(f"jvllm: error: MODEL {args.model_tag!r} and --model {args.model!r} disagree", file=sys.stderr)
        return 2
    args.model = args.model_tag or args.model
    settings = dict(served_model_names=args.served_model_name, api_key=args.api_key,
                    enable_log_requests=args.enable_log_requests, chat_template=args.chat_template,
                    max_logprobs=args.max_logprobs, max_n=args.max_n, max_prompt_chars=args.max_prompt_chars,
                    trust_request_chat_template=args.trust_request_chat_template,
                    allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                    allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                    enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                    reasoning_parser=args.reasoning_parser)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        print("jvllm: error: --enable-auto-tool-choice needs --tool-call-parser", file=sys.stderr)
        return 2
    if args.max_request_body_bytes is not None:
        settings["max_request_body_bytes"] = args.max_request_body_bytes
    try:
        return run_server({**engine_kwargs(args), "reasoning_parser": args.reasoning_parser}, settings, host=args.host, port=args.port,
                          max_waiting_requests=args.max_waiting_requests, shutdown_timeout=args.shutdown_timeout,
                          log_level=args.log_level, access_log=not args.disable_access_log)
    except (ValueError, FileNotFoundError) as error:
        print(f"jvllm: error: {error}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # jvllm never downloads weights at run time
    # transformers (tokenizers, chat templates) otherwise greets a torch-free install with "PyTorch was not
    # found. Models won't be available": true of transformers' models, misleading for jvllm's.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "chat":
        from entrypoints.chat_client import run_chat

        return run_chat(args, engine_kwargs(args))
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
