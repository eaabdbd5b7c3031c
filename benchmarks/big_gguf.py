"""A Llama-3-8B-shaped GGUF with dummy Q4_K_M-style weights (Q4_K projections and embedding, Q6_K output) on this
machine: written once, loaded with the default engine settings, decoded; prints start-up time, resident memory
against the file's tensor bytes, and decode tok/s.

    python -m benchmarks.big_gguf [--path /tmp/llama3-8b-q4_k.gguf] [--tokens 16]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import time

import numpy as np

# Llama-3-8B's shapes.
SHAPE = dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256, context=8192,
             rope_theta=500000.0, rms_eps=1e-5)


def _tensors(shape: dict) -> list[tuple[str, tuple[int, int], str]]:
    """(GGUF name, (rows, row weights), format) of every 2-D weight, in file order."""
    h, f, head_dim = shape["hidden"], shape["intermediate"], shape["hidden"] // shape["heads"]
    kv = shape["kv_heads"] * head_dim
    out = [("token_embd.weight", (shape["vocab"], h), "q4_k")]
    for i in range(shape["layers"]):
        out += [(f"blk.{i}.attn_q.weight", (h, h), "q4_k"), (f"blk.{i}.attn_k.weight", (kv, h), "q4_k"),
                (f"blk.{i}.attn_v.weight", (kv, h), "q6_k" if i % 4 == 0 else "q4_k"),
                (f"blk.{i}.attn_output.weight", (h, h), "q4_k"), (f"blk.{i}.ffn_gate.weight", (f, h), "q4_k"),
                (f"blk.{i}.ffn_up.weight", (f, h), "q4_k"),
                (f"blk.{i}.ffn_down.weight", (h, f), "q6_k" if i % 4 == 0 else "q4_k")]
    return out + [("output.weight", (shape["vocab"], h), "q6_k")]


def write_dummy_gguf(path: pathlib.Path, shape: dict = SHAPE, seed: int = 0) -> int:
    """The file at `path` (random codes, set scales; the SmolLM2 vocabulary padded with unused tokens);
    -> its tensor bytes."""
    import gguf

    from jvllm.model_loader.default_model import default_model_path
    from models.quantized import random_blocks

    source = gguf.GGUFReader(default_model_path())
    tokens = list(source.fields["tokenizer.ggml.tokens"].contents())
    types = list(source.fields["tokenizer.ggml.token_type"].contents())
    padding = shape["vocab"] - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(padding)]
    types += [int(gguf.TokenType.UNUSED)] * padding
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(shape["layers"])
    writer.add_context_length(shape["context"])
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["intermediate"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_freq_base(shape["rope_theta"])
    writer.add_layer_norm_rms_eps(shape["rms_eps"])
    writer.add_rope_dimension_count(shape["hidden"] // shape["heads"])
    writer.add_vocab_size(shape["vocab"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(source.fields["tokenizer.ggml.pre"].contents())
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(source.fields["tokenizer.ggml.merges"].contents()))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    rng = np.random.default_rng(seed)
    total = 0
    norms = [f"blk.{i}.{n}.weight" for i in range(shape["layers"]) for n in ("attn_norm", "ffn_norm")]
    for name in norms + ["output_norm.weight"]:
        writer.add_tensor(name, np.ones(shape["hidden"], np.float32))
        total += shape["hidden"] * 4
    for name, (rows, k), fmt in _tensors(shape):
        raw = random_blocks(rows, k, fmt, rng)
        writer.add_tensor(name, raw, raw_dtype=getattr(gguf.GGMLQuantizationType, fmt.upper()))
        total += raw.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return total


def _rss_bytes(kind: str = "VmRSS") -> int:
    """Resident bytes of this process: VmRSS (all), RssAnon (its own memory) or RssFile (mapped files' pages)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{kind}:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default="/tmp/llama3-8b-q4_k.gguf", help="where the dummy GGUF is (written if absent)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens to decode after a short prompt")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args()
    path = pathlib.Path(args.path)
    if not path.exists():
        started = time.perf_counter()
        write_dummy_gguf(path)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - started:.0f}s", flush=True)
    import gguf

    tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    from jvllm import LLM, SamplingParams

    rss_before, anon_before = _rss_bytes(), _rss_bytes("RssAnon")
    started = time.perf_counter()
    llm = LLM(str(path), max_model_len=args.max_model_len, kv_cache_memory_bytes=1 << 30)
    start_up = time.perf_counter() - started
    rss_loaded, anon_loaded, file_loaded = _rss_bytes(), _rss_bytes("RssAnon"), _rss_bytes("RssFile")
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(["Warm-up on another prompt."], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    started = time.perf_counter()
    out = llm.generate(["The capital of France is"], params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - started
    result = dict(
        model="Llama-3-8B-shaped, dummy Q4_K/Q6_K", file_bytes=path.stat().st_size, tensor_bytes=tensor_bytes,
        weight_bytes=llm.weight_bytes,
        rss_after_load=rss_loaded, rss_growth_at_load=rss_loaded - rss_before, anon_growth_at_load=anon_loaded -
        anon_before, file_pages_after_load=file_loaded, kv_cache_bytes=1 << 30,
        peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, start_up_s=round(start_up, 1),
        decoded_tokens=len(out.outputs[0].token_ids), decode_tok_per_s=round(len(out.outputs[0].token_ids) / elapsed, 2),
        cpus=os.cpu_count())
    result["weight_over_tensor_bytes"] = round(result["weight_bytes"] / tensor_bytes, 3)
    result["rss_over_tensor_bytes"] = round(rss_loaded / tensor_bytes, 3)
    # what loading kept of its own beside the KV pool, against the file's tensors
    result["anon_less_kv_over_tensor_bytes"] = round((anon_loaded - anon_before - (1 << 30)) / tensor_bytes, 3)
    print(json.dumps(result, indent=1))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
