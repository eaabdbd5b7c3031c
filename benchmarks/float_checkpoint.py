"""A float checkpoint on CPU: memory at start and single-stream decode, default settings against float32 weights.

Each engine starts in a fresh process (peak memory is per process) that reports: the peak of anonymous resident
memory while the engine starts (sampled every 20 ms), resident memory once it is ready, the weight bytes it holds,
start-up seconds, and single-stream greedy decode tok/s over uneven chat prompts after a warm-up prompt. Settings
alternate, round by round. `--write-random DIR` first writes a random bf16 Llama checkpoint of about 1.6B
parameters (hidden 2,048, 32 layers: its float32 weights take over a quarter of a 24 GB host) with the embedded
model's tokenizer.

    python -m benchmarks.float_checkpoint --model FOLDER [--rounds 2] [--json out.json]
    python -m benchmarks.float_checkpoint --write-random /tmp/random-1.6b --model /tmp/random-1.6b
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

# name -> Engine keyword arguments
SETTINGS = {
    "default": {},
    "float32_weights": {"batched_weight_dtype": None},  # float32 matrices, no bf16 copy
    "float32_then_copy": {"dtype": "float32", "batched_weight_dtype": "bfloat16"},  # a bf16 copy made from float32
}
RANDOM_SHAPE = dict(hidden_size=2048, num_hidden_layers=32, intermediate_size=5632, num_attention_heads=32,
                    num_key_value_heads=8)


def write_random_checkpoint(folder: str, seed: int = 0) -> None:
    """A random bf16 LlamaForCausalLM (RANDOM_SHAPE, untied head) with the embedded model's tokenizer."""
    import pathlib
    import shutil

    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from jvllm.model_loader.loader import transformers_folder

    source = pathlib.Path(transformers_folder())  # the embedded model as an HF folder
    out = pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    config = json.loads((source / "config.json").read_text())
    config.pop("head_dim", None)
    config.update(RANDOM_SHAPE, tie_word_embeddings=False, torch_dtype="bfloat16", max_position_embeddings=4096)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    rng = np.random.default_rng(seed)
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    ones = np.ones(hidden, ml_dtypes.bfloat16)
    shard = {"model.embed_tokens.weight": weight(config["vocab_size"], hidden),
             "lm_head.weight": weight(config["vocab_size"], hidden), "model.norm.weight": ones}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shard.update({p + "self_attn.q_proj.weight": weight(hidden, hidden), p + "self_attn.k_proj.weight":
                      weight(kv, hidden), p + "self_attn.v_proj.weight": weight(kv, hidden),
                      p + "self_attn.o_proj.weight": weight(hidden, hidden),
                      p + "mlp.gate_proj.weight": weight(inner, hidden), p + "mlp.up_proj.weight": weight(inner, hidden),
                      p + "mlp.down_proj.weight": weight(hidden, inner), p + "input_layernorm.weight": ones,
                      p + "post_attention_layernorm.weight": ones})
        if layer % 8 == 7 or layer == config["num_hidden_layers"] - 1:
            save_file(shard, str(out / f"model-{layer // 8:05d}.safetensors"), metadata={"format": "pt"})
            shard = {}


def _status_mib(field: str) -> int:
    """A memory field of /proc/self/status (RssAnon, VmRSS, ...) in MiB."""
    status = open("/proc/self/status").read()
    return int(status.split(field + ":")[1].split()[0]) // 1024


def measure(model: str, setting: str, num_prompts: int, tokens: int) -> dict:
    """One engine in this process: its start-up memory and time, and its single-stream decode speed."""
    peak = [0]

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], _status_mib("RssAnon"))
            time.sleep(0.02)

    threading.Thread(target=sample, daemon=True).start()
    from benchmarks import workloads
    from jvllm import Engine, SamplingParams

    started = time.perf_counter()
    engine = Engine(model, **SETTINGS[setting])
    start_s = time.perf_counter() - started
    result = {"setting": setting, "start_s": round(start_s, 1), "peak_anon_mib_at_start": peak[0],
              "resident_mib_ready": _status_mib("VmRSS"), "weight_mb": round(engine.weight_bytes / 1e6, 1)}
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    messages = workloads.chat_messages(num_prompts + 1, seed=7)
    engine.chat(messages[0], params, use_tqdm=False)  # warm-up on another prompt
    speeds = []
    for conversation in messages[1:]:
        started = time.perf_counter()
        (out,) = engine.chat(conversation, params, use_tqdm=False)
        speeds.append(len(out.outputs[0].token_ids) / (time.perf_counter() - started))
    result["decode_tok_s"] = [round(s, 2) for s in speeds]
    result["decode_tok_s_mean"] = round(sum(speeds) / len(speeds), 2)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an HF folder with a float (bf16/fp16/fp32) checkpoint")
    parser.add_argument("--settings", default="default,float32_weights", help=f"comma-separated: {', '.join(SETTINGS)}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=3, help="chat prompts decoded one at a time")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--write-random", metavar="DIR", help="first write a random bf16 checkpoint there")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: measure this setting and print JSON
    args = parser.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(measure(args.model, args.one, args.num_prompts, args.tokens)), flush=True)
        return 0
    from benchmarks.common import command_line, machine_info, write_json

    if args.write_random:
        write_random_checkpoint(args.write_random)
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}")
    rounds: dict[str, list[dict]] = {s: [] for s in settings}
    for round_index in range(args.rounds):
        for setting in settings if round_index % 2 == 0 else settings[::-1]:
            child = subprocess.run([sys.executable, "-m", "benchmarks.float_checkpoint", "--model", args.model,
                                    "--one", setting, "--num-prompts", str(args.num_prompts), "--tokens",
                                    str(args.tokens)], capture_output=True, text=True)
            lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
            if child.returncode != 0 or not lines:
                print(child.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{setting}: the engine process failed (exit {child.returncode})")
            result = json.loads(lines[-1][len("RESULT "):])
            rounds[setting].append(result)
            print(json.dumps(result), flush=True)
    base = settings[-1]
    summary = {}
    for setting in settings:
        speed = sum(r["decode_tok_s_mean"] for r in rounds[setting]) / len(rounds[setting])
        base_speed = sum(r["decode_tok_s_mean"] for r in rounds[base]) / len(rounds[base])
        summary[setting] = {"decode_tok_s": round(speed, 2), "decode_ratio_to_" + base: round(speed / base_speed, 3),
                            "peak_anon_mib_at_start": max(r["peak_anon_mib_at_start"] for r in rounds[setting]),
                            "resident_mib_ready": max(r["resident_mib_ready"] for r in rounds[setting]),
                            "weight_mb": rounds[setting][0]["weight_mb"]}
        print(f"{setting}: decode {speed:.2f} tok/s ({speed / base_speed:.2f}x {base}), peak at start "
              f"{summary[setting]['peak_anon_mib_at_start']} MiB, resident when ready "
              f"{summary[setting]['resident_mib_ready']} MiB, weights {summary[setting]['weight_mb']} MB")
    write_json(args.json, {"command": command_line("benchmarks.float_checkpoint", argv), "machine": machine_info(),
                           "model": args.model, "summary": summary, "rounds": rounds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
