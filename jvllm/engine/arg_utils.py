"""EngineArgs: every engine option once (type, default, help, check); it makes `Engine(...)`'s keywords and the CLI flags."""
from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
from typing import Any, Callable

from jvllm.utils import check_positive
from jvllm.multimodal.media import DEFAULT_MAX_IMAGE_PIXELS
from jvllm.spec_decode.config import SpeculativeConfig
from jvllm.structured.reasoning import REASONING_ENDS

ENGINE_GROUP = "engine"
MULTIHOST_GROUP = "multi-host (one mesh over several processes; run the same command on each)"


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
    """A JSON list of strings, e.g. '["https://example.com"]' (the server's CORS flags, as vLLM's)."""
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


def json_speculative(text: str) -> dict:
    """--speculative-config takes a JSON object, as vLLM's does."""
    return json_object(text, '{"method": "ngram", "num_speculative_tokens": 4}')


def json_limits(text: str) -> dict[str, int]:
    """--limit-mm-per-prompt takes a JSON object of modality -> count, e.g. '{"image": 4}', as vLLM's does."""
    value = json_object(text, '{"image": 4}')
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
        raise argparse.ArgumentTypeError(f"expected a JSON object of integers, got {text!r}")
    return value


def option(default: Any, help: str, *, parse: Callable[[str], Any] | None = None, choices: list[str] | None = None,
           nargs: str | None = None, metavar: str | None = None, aliases: tuple[str, ...] = (),
           group: str = ENGINE_GROUP) -> Any:
    """A dataclass field that is also a command-line flag (`--field-name`). `parse` turns the flag's text into the
    value (default: the text). A boolean that defaults to False is a plain switch; one that defaults to True or None
    gets --flag / --no-flag."""
    flag = dict(help=help, parse=parse, choices=choices, nargs=nargs, metavar=metavar, aliases=aliases, group=group)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"flag": flag})
    return dataclasses.field(default=default, metadata={"flag": flag})


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of the dataclass `cls` (made by `option`), in groups named by the fields."""
    groups: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        flag = field.metadata.get("flag")
        if flag is None or field.name in skip:
            continue
        if flag["group"] not in groups:
            groups[flag["group"]] = parser.add_argument_group(flag["group"])
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        names = ["--" + field.name.replace("_", "-"), *flag["aliases"]]
        kwargs: dict[str, Any] = dict(default=default, help=flag["help"], dest=field.name)
        if default is False:
            kwargs["action"] = "store_true"
        elif isinstance(default, bool) or field.type == "bool | None":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update({key: flag[key] for key in ("choices", "nargs", "metavar") if flag[key] is not None})
            if flag["parse"] is not None:
                kwargs["type"] = flag["parse"]
        groups[flag["group"]].add_argument(*names, **kwargs)


def dataclass_from_flags(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """The dataclass `cls` built from parsed flags (fields without a flag keep their defaults)."""
    values = {field.name: getattr(args, field.name) for field in dataclasses.fields(cls) if hasattr(args, field.name)}
    return cls(**{**values, **overrides})


@dataclasses.dataclass
class EngineArgs:
    """Every option of an engine. `Engine(model, **keywords)` takes these fields as keywords and `jvllm
    generate/serve/chat` as flags (`max_num_seqs` -> `--max-num-seqs`). Adding a field adds both."""

    model: str | None = option(None, "HF folder with config.json, a .gguf file, or a known name "
                                     "(default: the embedded SmolLM2-135M-Instruct)")
    tokenizer: str | None = option(None, "tokenizer folder if not the model's own")
    served_model_name: str | list[str] | None = option(
        None, "name(s) clients use in 'model'; the first is reported (default: the model's name)", nargs="+",
        metavar="NAME")
    dtype: str = option("auto", "auto (on CPU float32 activations with bfloat16 weight matrices, loaded so where "
                                "every step reads them in bfloat16; bfloat16 on GPU; a GGUF model keeps its quantized "
                                "blocks on CPU), float32 (every step in float32, GGUF dequantized), bfloat16")
    quantization: str | None = option(
        None, "gguf: keep a GGUF model's quantized blocks whatever the dtype and backend (by default they are kept "
              "with dtype auto on one CPU device, as llama.cpp does); int8: quantize a float checkpoint's projections "
              "and embeddings at load (on CPU int8 with a scale per 32 weights, GGUF's Q8_0 layout; on GPU int8 with "
              "a scale per output channel); fp8 (GPU only): float8_e4m3fn with a scale per output channel. "
              "Activations stay in the engine's dtype: weight-only quantization", choices=["gguf", "int8", "fp8"])
    load_format: str = option("auto", "auto, safetensors, gguf or dummy (random weights)",
                              choices=["auto", "safetensors", "gguf", "dummy"])
    seed: int = option(0, "engine seed for unseeded requests", parse=int)
    generation_config: str = option("auto", "default sampling parameters: auto (the model's generation_config.json: "
                                            "its temperature, top_p, top_k, min_p, repetition_penalty and "
                                            "max_new_tokens, as vLLM reads them), vllm (SamplingParams' own "
                                            "defaults), or a folder holding a generation_config.json")
    override_generation_config: dict[str, Any] | None = option(
        None, 'values over the generation config\'s, e.g. \'{"temperature": 0.5}\' (its field names)',
        parse=json_object, metavar="JSON")
    max_model_len: int | None = option(None, "context limit, prompt + output (default: the model's, as far as the "
                                             "KV pool holds)", parse=human_int)
    max_num_seqs: int | None = option(None, "sequences per step (default 256; 128 for `jvllm serve` on CPU, as "
                                            "vLLM's server)", parse=human_int)
    max_num_batched_tokens: int | None = option(None, "tokens per step (default 2048 on CPU, 8192 on GPU)",
                                                parse=human_int)
    block_size: int = option(16, "tokens per KV page (a power of two)", parse=int)
    kv_cache_memory_bytes: int | None = option(None, "KV pool size in bytes per device (default 1 GiB on CPU, 85%% "
                                                     "of free memory on GPU)", parse=human_int)
    kv_cache_dtype: str = option("auto", "what the KV pages hold: auto (the model's dtype; on CPU bfloat16 for a GGUF "
                                         "model served from its blocks, like llama.cpp's 16-bit KV cache, and for a "
                                         "float checkpoint whose matrices are loaded in bfloat16), bfloat16, float32, "
                                         "or fp8_e5m2 (8-bit floats, half of bfloat16's bytes, as vLLM's CPU build "
                                         "stores them; cpu and xla attention backends)",
                                 choices=["auto", "bfloat16", "float32", "fp8_e5m2"])
    enable_prefix_caching: bool = option(True, "reuse the KV pages of shared prompt prefixes (default on)")
    attention_backend: str = option("auto", "auto (pallas on GPU, cpu on CPU); pallas (Pallas Triton "
                                            "paged-attention kernels for GPUs, interpret mode on CPU), mosaic (the "
                                            "Mosaic GPU kernels for Hopper, jax >= 0.11), cpu (native "
                                            "C++ kernels), xla (plain jnp, gathers each sequence's pages: the "
                                            "reference)", choices=["auto", "pallas", "mosaic", "cpu", "xla"])
    batched_weight_dtype: str | None = option(
        "auto", "extra weight copy for steps of 2+ token rows: auto (bfloat16 when a float32 model runs on CPU "
                "because dtype is auto; ~1.6x faster batched steps, outputs then depend slightly on the batch; for "
                "an embedding model only on CPUs with AVX-512 BF16, for batches of 512+ padded tokens), none, "
                "or a dtype such as bfloat16. GGUF blocks get no copy; on CPUs with AVX-512 BF16 their products of "
                "2+ rows run in bfloat16 unless this is none or float32; int8: as auto, and products of 9+ rows "
                "with Q4_0/Q4_1/Q4_K/Q5_K blocks take 8-bit activations on CPUs with AVX-512 VNNI (Q4_0/Q4_1 on other "
                "AVX2 CPUs), as llama.cpp computes them (prefill ~1.25-1.4x faster, greedy outputs further from "
                "float32's than with bfloat16 or int16 activations)")
    batch_invariant: bool | None = option(
        None, "each token row of a step of up to 16 rows (8 on CPUs without AVX-512 and for models with other "
              "than GGUF blocks) computes the bits it would alone, as vLLM's VLLM_BATCH_INVARIANT: greedy outputs "
              "are then the same with and without speculative decoding and whatever else shares such a step. "
              "Default: on for GGUF blocks with the cpu attention backend on CPUs with AVX-512 or AVX2 (int16 "
              "activations, each row multiplied alone: it costs nothing; speculation then verifies at most 15 or 7 "
              "drafts a step), off elsewhere")
    scheduling_policy: str = option("fcfs", "fcfs: requests run in arrival order; priority: by each request's "
                                            "`priority` (lower first, then arrival), preempting running requests of "
                                            "lower priority when a higher one waits without room",
                                    choices=["fcfs", "priority"])
    async_scheduling: bool = option(True, "dispatch each decode step before the previous step's tokens reach the "
                                          "host, so host work overlaps the device's (one device only; default on)")
    speculative_config: dict[str, Any] | None = option(
        None, 'speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 4}\' (drafts from '
              'the prompt and output: prompt_lookup_min/max tokens must match), \'{"method": "suffix"}\' (drafts '
              'from the longest matching suffix in this and earlier outputs) or \'{"method": "draft_model", "model": '
              'PATH, "num_speculative_tokens": 3}\' (a smaller model of the same tokenizer drafts greedily, in an '
              'engine of its own). Greedy and seeded outputs are those '
              'without it; only batches of at most max_batch_size (default 4) requests speculate',
        parse=json_speculative, metavar="JSON")
    precompile: bool = option(True, "compile every step shape before serving (default on; loaded from the cache "
                                    "after the first start; `generate` compiles only the shapes its one prompt can "
                                    "meet); --no-precompile compiles each shape when first used")
    tensor_parallel_size: int = option(1, "devices to shard the model over (tensor parallelism; all hosts' devices "
                                          "together)", parse=int, aliases=("-tp",))
    reasoning_parser: str | None = option(None, "the model thinks first, up to </think>: structured outputs apply "
                                                "to what follows (the server moves the thinking into "
                                                "message.reasoning_content)", choices=sorted(REASONING_ENDS))
    pooling: str | None = option(None, "embedding pooling (mean, cls, last, max, mean_sqrt_len): overrides an "
                                       "embedding model's sentence-transformers config; on a generative model it "
                                       "enables embed()")
    normalize: bool | None = option(None, "L2-normalize embeddings (default: the embedding model's config)")
    limit_mm_per_prompt: dict[str, int] | None = option(
        None, 'images per prompt of a vision-language model, e.g. \'{"image": 4}\' (default 999)', parse=json_limits,
        metavar="JSON")
    mm_processor_kwargs: dict[str, Any] | None = option(
        None, "image processor settings of a vision-language model, e.g. Qwen2-VL's '{\"max_pixels\": 802816}' "
              "(pixels per image; 28 x 28 pixels make one image token)", parse=json_object, metavar="JSON")
    encoder_cache_tokens: int | None = option(
        None, "rows of the device buffer of encoded images, which keeps repeated images from being encoded again "
              "(default: twice max-num-batched-tokens and at least 8 of the largest images)", parse=human_int)
    allowed_local_media_path: str | None = option(
        None, "folder that file: image URLs may read from (default: none; file: URLs are refused)", metavar="DIR")
    allowed_media_domains: list[str] | None = option(
        None, "the only hosts (names or IP addresses) http(s) image URLs may be fetched from; listed hosts may be "
              "private or loopback (default: any host, but public addresses only: loopback, private, link-local and "
              "cloud metadata addresses are refused)", nargs="+", metavar="HOST")
    max_image_pixels: int = option(DEFAULT_MAX_IMAGE_PIXELS, "largest decoded image (width x height), checked before "
                                                             "decoding (default 16777216, 4096 x 4096)",
                                   parse=human_int, metavar="N")
    num_hosts: int | None = option(None, "processes in the deployment (default: $JVLLM_NUM_HOSTS, else 1)", parse=int,
                                   group=MULTIHOST_GROUP)
    host_rank: int | None = option(None, "this process's rank, 0 to num-hosts - 1; rank 0 schedules (and serves "
                                         "HTTP), the others follow its steps (default: $JVLLM_HOST_RANK, else 0)",
                                   parse=int, group=MULTIHOST_GROUP)
    coordinator: str | None = option(None, "rank 0's address for jax.distributed, reachable by every host "
                                           "(default: $JVLLM_COORDINATOR)", metavar="HOST:PORT",
                                     group=MULTIHOST_GROUP)

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, list) and len(self.served_model_name) == 1:
            self.served_model_name = self.served_model_name[0]
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes",
                     "encoder_cache_tokens"):
            check_positive(name, getattr(self, name))
        for name in ("block_size", "tensor_parallel_size", "max_image_pixels"):
            check_positive(name, getattr(self, name), optional=False)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.attention_backend == "mosaic" and self.block_size < 8:
            raise ValueError(f"attention_backend 'mosaic' copies whole pages of at least 8 tokens (TMA tiles); "
                             f"block_size {self.block_size} is smaller")
        if self.pooling is not None and self.tensor_parallel_size != 1:
            raise ValueError("embedding with a generative model (pooling=...) runs on one device; "
                             "use tensor_parallel_size=1")
        SpeculativeConfig.parse(self.speculative_config)  # a bad config fails here, before the model loads
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_ENDS:
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}; known: {', '.join(REASONING_ENDS)}")

    @property
    def served_model_names(self) -> list[str]:
        """The served names as a list (empty: the model's own name)."""
        name = self.served_model_name
        return [] if name is None else [name] if isinstance(name, str) else list(name)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
        """Add one flag per field (`skip`: fields a command sets itself)."""
        add_dataclass_flags(parser, cls, skip=skip)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> "EngineArgs":
        return dataclass_from_flags(cls, args, **overrides)



def keyword_help() -> str:
    """The keywords `Engine` takes, a paragraph each with its type, default and help (for its docstring)."""
    paragraphs = []
    for field in dataclasses.fields(EngineArgs):
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        text = f"{field.name} ({field.type}, default {default!r}): {field.metadata['flag']['help']}"
        paragraphs.append(textwrap.fill(text.replace("%%", "%"), 116, initial_indent=" " * 8,
                                        subsequent_indent=" " * 12))
    return "\n".join(paragraphs)


MULTIHOST_FIELDS = tuple(field.name for field in dataclasses.fields(EngineArgs)
                         if field.metadata["flag"]["group"] == MULTIHOST_GROUP)
