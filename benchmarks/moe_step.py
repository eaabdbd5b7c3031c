"""Mixture-of-experts decode cost: a Mixtral-shaped MoE against a dense model with the same active parameters.

Both models have dummy weights, the same attention, hidden size and depth; the MoE has `--experts` experts of
width `--expert-width` and routes each token to `--top-k` of them, the dense model's MLP is top_k x expert_width
wide. Each runs `--rows` concurrent requests (uneven prompts of 8-24 tokens) for `--output-len` greedy tokens
after a warm-up pass on other prompts; the figure is the median decode-step time of the timed pass (prefill steps
excluded) and the MoE / dense ratio from the same run.

    python -m benchmarks.moe_step [--rows 64] [--json benchmarks/results/moe_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import command_line, machine_info, write_json
from benchmarks.gpu_models import TOKENIZER_FILES


def model_folders(root: Path, args: argparse.Namespace) -> dict[str, Path]:
    shape = {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 64,
             "num_key_value_heads": args.hidden // 256, "head_dim": 64, "rms_norm_eps": 1e-5,
             "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
             "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2}
    configs = {
        "moe": {**shape, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "intermediate_size": args.expert_width, "num_local_experts": args.experts,
                "num_experts_per_tok": args.top_k},
        "dense": {**shape, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                  "intermediate_size": args.expert_width * args.top_k},
    }
    from jvllm.model_loader.loader import transformers_folder

    source = Path(transformers_folder(None))
    folders = {}
    for name, config in configs.items():
        folder = root / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        for file in TOKENIZER_FILES:
            if (source / file).is_file():
                (folder / file).write_bytes((source / file).read_bytes())
        folders[name] = folder
    return folders


def decode_step_times(folder: Path, args: argparse.Namespace) -> dict:
    """-> median decode-step seconds of the timed pass, and the engine's start time."""
    import jax
    import numpy as np

    from jvllm import Engine, SamplingParams
    from jvllm.worker.model_runner import ModelRunner

    started = time.perf_counter()
    engine = Engine(str(folder), load_format="dummy", max_num_seqs=args.rows, max_model_len=512,
                    kv_cache_memory_bytes=256 << 20)
    start_s = time.perf_counter() - started
    step_seconds: list[float] = []
    run_call = ModelRunner.run_call

    def timed(runner: ModelRunner, call, *rest):
        begun = time.perf_counter()
        out = run_call(runner, call, *rest)
        if call.shape.kind == "decode":
            jax.block_until_ready(out)
            step_seconds.append(time.perf_counter() - begun)
        return out

    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    ModelRunner.run_call = timed
    try:
        for _ in ("warm-up", "timed"):
            step_seconds.clear()
            prompts = [{"prompt_token_ids": rng.integers(100, 40000, int(n)).tolist()}
                       for n in rng.integers(8, 25, args.rows)]
            engine.generate(prompts, params, use_tqdm=False)
    finally:
        ModelRunner.run_call = run_call
    return {"decode_step_ms_median": 1e3 * statistics.median(step_seconds), "decode_steps": len(step_seconds),
            "start_s": start_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="concurrent requests (decode rows per step)")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--expert-width", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        folders = model_folders(Path(root), args)
        results = {name: decode_step_times(folder, args) for name, folder in folders.items()}
    ratio = results["moe"]["decode_step_ms_median"] / results["dense"]["decode_step_ms_median"]
    for name, result in results.items():
        print(f"{name:6s} decode step at {args.rows} rows: {result['decode_step_ms_median']:.2f} ms "
              f"(median of {result['decode_steps']}), start {result['start_s']:.1f} s")
    print(f"MoE / dense step time: {ratio:.2f}x (target <= 1.5x)")
    write_json(args.json, {"command": command_line("benchmarks.moe_step", argv), "machine": machine_info(),
                           "settings": vars(args), "results": results, "moe_over_dense": ratio})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
