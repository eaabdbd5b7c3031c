"""The `jvllm` command line: `jvllm generate PROMPT`, `jvllm serve [MODEL]`, `jvllm chat`, `jvllm bench`; flags from
EngineArgs."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from jvllm.collector import own_process
from jvllm.engine.arg_utils import EngineArgs, MULTIHOST_FIELDS, add_dataclass_flags, dataclass_from_flags, human_int
from entrypoints.bench import add_bench_parser, run_bench
from server.settings import ServerSettings


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
    EngineArgs.add_cli_args(gen)
    _add_serve_parser(commands)
    _add_chat_parser(commands)
    add_bench_parser(commands)
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
    add_dataclass_flags(serve, ServerSettings)
    serve.set_defaults(api_key=os.environ.get("JVLLM_API_KEY"))
    EngineArgs.add_cli_args(serve)


_CHAT_HELP = """\
Chat in the terminal; replies stream token by token. Against a running server:
  jvllm chat --url http://localhost:8000/v1 [--api-key KEY]
or, without --url, with an engine loaded in this process (engine flags below). With --url, --model is the
served model name (default: the server's first model). Type a message and press Enter. Ctrl-C stops a reply
and keeps the conversation; /clear or /reset forgets it, /system TEXT sets the system message, /save PATH writes
the conversation as JSON, /exit, Ctrl-D or Ctrl-C at the prompt ends the chat."""


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
    chat.add_argument("--quiet", action="store_true",
                      help="no start-up progress lines while the in-process engine loads (errors still show)")
    EngineArgs.add_cli_args(chat, skip=MULTIHOST_FIELDS)


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
        engine = Engine.from_engine_args(EngineArgs.from_cli_args(args, precompile=False))
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
    try:
        engine = EngineArgs.from_cli_args(args)
        settings = dataclass_from_flags(ServerSettings, args, served_model_names=engine.served_model_names,
                                        model_root=args.model, reasoning_parser=args.reasoning_parser)
        return run_server(engine, settings)
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
    if args.command == "bench":
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
        try:
            return run_bench(args)
        except (ValueError, FileNotFoundError, RuntimeError) as error:
            print(f"jvllm bench: error: {error}", file=sys.stderr)
            return 2
    if args.command == "chat":
        from entrypoints.chat_client import run_chat

        try:
            options = EngineArgs.from_cli_args(args)
        except ValueError as error:
            print(f"jvllm: error: {error}", file=sys.stderr)
            return 2
        return run_chat(args, options)
    parser.print_help()
    return 0


if __name__ == "__main__":
    own_process()  # as the `jvllm` command (entrypoints.command), less the imports already done
    sys.exit(main())
