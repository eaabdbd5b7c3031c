"""Offline throughput: jvllm vs transformers' batched generate on the same prompt ids, in the same run.

The engine is `Engine()` with default settings (options only where flags say). Scenarios (all greedy,
ignore_eos, prefill included in the timing; each timed --repeats times after a warm-up, the median reported):
  chat     uneven chat prompts x output-len tokens, jvllm vs transformers, each pass on new prompts
  traffic  fixed-length vs long-tailed prompt and output lengths with the same totals (benchmarks/traffic.py), with
           --traffic-requests requests (sustained traffic) and with --num-prompts (one batch: its longest output
           decodes alone at the end)
  batch   N prompts x input-len tokens -> output-len tokens, jvllm and transformers, ratio printed; the two
          engines' timed passes alternate (jvllm, transformers, jvllm, ...), so a drift of the machine's speed
          during the run reaches both sides of the ratio
  single  one request's decode speed vs the memory-bandwidth bound (weight bytes / measured bandwidth)
  wide    64 concurrent requests, output tokens/s
  prefill --prefill-prompts prompts of --prefill-len tokens, one output token each: prompt tokens/s
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from benchmarks.common import command_line, machine_info, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class ReadBandwidthProbe:
    """Device read bandwidth in bytes/s: a reduction over a large float32 array, best of `tries` per call."""

    def __init__(self, num_bytes: int = 1 << 30):
        import jax
        import jax.numpy as jnp

        self.num_bytes = num_bytes
        self._x = jnp.ones(num_bytes // 4, jnp.float32)
        self._total = jax.jit(jnp.sum)
        self._total(self._x).block_until_ready()

    def __call__(self, tries: int = 5) -> float:
        return self.num_bytes / min(_timed(lambda: self._total(self._x).block_until_ready()) for _ in range(tries))


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab - 100, size=length).tolist() for _ in range(num)]


def _warmed_inputs(engine, prompts: list[list[int]], output_len: int) -> tuple[list[dict], object]:
    """Greedy fixed-length inputs for `prompts`, after one untimed pass that compiles every shape they need."""
    from jvllm import SamplingParams

    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    _jvllm_pass(engine, inputs, params)
    return inputs, params


def _jvllm_pass(engine, inputs: list[dict], params) -> tuple[float, list]:
    """One generate of every prompt with the prefix cache emptied first; -> (seconds, outputs). Every pass
    computes each prompt as the warm-up did (so it needs no new shapes) and as transformers does (no KV reused)."""
    engine.reset_prefix_cache()
    started = time.perf_counter()
    outputs = engine.generate(inputs, params, use_tqdm=False)
    return time.perf_counter() - started, outputs


def warm_then_time(engine, prompts: list[list[int]], output_len: int, repeats: int = 1) -> list[float]:
    """Greedy fixed-length generation of `prompts`, run once to compile every shape it needs, then timed
    `repeats` times; -> seconds of each timed pass."""
    inputs, params = _warmed_inputs(engine, prompts, output_len)
    return [_jvllm_pass(engine, inputs, params)[0] for _ in range(repeats)]


def run_prefill(engine, prompts: list[list[int]], repeats: int) -> dict:
    """Prompt tokens/s of prompts that each produce one token (the prefix cache emptied before every pass)."""
    passes = warm_then_time(engine, prompts, 1, repeats)
    elapsed = statistics.median(passes)
    tokens = sum(map(len, prompts))
    return {"seconds": elapsed, "pass_seconds": passes, "prompt_tokens": tokens,
            "prompt_tokens_per_s": tokens / elapsed}


def _rates(passes: list[float], prompts: list[list[int]], output_len: int) -> dict:
    elapsed = statistics.median(passes)
    out_tokens = len(prompts) * output_len
    return {"seconds": elapsed, "pass_seconds": passes, "requests_per_s": len(prompts) / elapsed,
            "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": (out_tokens + sum(map(len, prompts))) / elapsed}


def run_jvllm(engine, prompts: list[list[int]], output_len: int, repeats: int) -> dict:
    return _rates(warm_then_time(engine, prompts, output_len, repeats), prompts, output_len)


def run_single_decode(engine, prompt: list[int], output_len: int, repeats: int, weight_bytes: int) -> dict:
    """Decode-only speed of one request (time between its first and last token, median of the passes) against
    the bandwidth bound. The VM's read bandwidth drifts (32-63 GB/s between runs), so a probe runs right
    before each pass, and the bound uses the fastest probe of the run: the fraction errs low, never high."""
    from jvllm.worker.compile_watch import compile_watch

    inputs, params = _warmed_inputs(engine, [prompt], output_len)
    with compile_watch().expected():  # the probe's own two jits are not engine steps
        probe = ReadBandwidthProbe()
    bandwidths, rates = [], []
    for _ in range(repeats):
        bandwidths.append(probe())
        _, (out,) = _jvllm_pass(engine, inputs, params)
        rates.append((output_len - 1) / (out.metrics.last_token_time - out.metrics.first_token_time))
    rate, bandwidth = statistics.median(rates), max(bandwidths)
    return {"decode_tokens_per_s": rate, "pass_decode_tokens_per_s": rates, "weight_bytes": weight_bytes,
            "bandwidth_gb_s": bandwidth / 1e9, "pass_bandwidth_gb_s": [b / 1e9 for b in bandwidths],
            "bound_tokens_per_s": bandwidth / weight_bytes, "fraction_of_bound": rate * weight_bytes / bandwidth,
            "pass_fractions_of_own_probe": [r * weight_bytes / b for r, b in zip(rates, bandwidths)]}


class TransformersBaseline:
    """transformers' batched greedy `generate` (PyTorch, float32), one timed pass at a time. Prompts of uneven
    length are left-padded with an attention mask, as transformers' docs do for batched generation."""

    def __init__(self, folder: str, prompts: list[list[int]], output_len: int, threads: int):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self._torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.output_len = output_len
        self.use(prompts)

    def use(self, prompts: list[list[int]]) -> None:
        """Take these prompts for the next passes."""
        torch = self._torch
        width = max(map(len, prompts))
        self.ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        self.kwargs = dict(max_new_tokens=self.output_len, min_new_tokens=self.output_len, do_sample=False,
                           attention_mask=mask, pad_token_id=0)

    def warm(self) -> None:
        """A short generate, so the first timed pass does not pay PyTorch's one-time setup."""
        ids = self.ids[:, -8:]
        with self._torch.inference_mode():
            self.model.generate(ids, **{**self.kwargs, "max_new_tokens": 4, "min_new_tokens": 4,
                                        "attention_mask": self.kwargs["attention_mask"][:, -8:]})

    def timed_pass(self) -> float:
        with self._torch.inference_mode():
            return _timed(lambda: self.model.generate(self.ids, **self.kwargs))


def run_batch(engine, baseline: TransformersBaseline | None, prompts: list[list[int]], output_len: int,
              repeats: int) -> dict:
    """The batch scenario: both engines warmed up, then their timed passes alternated `repeats` times."""
    inputs, params = _warmed_inputs(engine, prompts, output_len)
    if baseline is not None:
        baseline.warm()
    jvllm_passes, baseline_passes = [], []
    for _ in range(repeats):
        jvllm_passes.append(_jvllm_pass(engine, inputs, params)[0])
        if baseline is not None:
            baseline_passes.append(baseline.timed_pass())
    result = {"jvllm": _rates(jvllm_passes, prompts, output_len)}
    if baseline is not None:
        transformers = _rates(baseline_passes, prompts, output_len)
        result["transformers"] = transformers
        result["ratio_vs_transformers"] = (result["jvllm"]["output_tokens_per_s"]
                                           / transformers["output_tokens_per_s"])
        result["pass_ratios"] = [b / j for j, b in zip(jvllm_passes, baseline_passes)]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: embedded SmolLM2-135M-Instruct")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, help="int8 or fp8 (GPUs): weights quantized at load")
    parser.add_argument("--attention-backend", default=None, help="e.g. mosaic (default: the engine's default)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="e.g. fp8_e5m2 (default: the engine's, auto)")
    parser.add_argument("--batched-weight-dtype", default=None,
                        help="weights for steps of >= 2 token rows, e.g. bfloat16 (default: the engine's default)")
    parser.add_argument("--scenarios", default="chat,traffic,batch,single,wide",
                        help="comma-separated: chat (uneven chat prompts vs transformers), traffic (fixed vs varied "
                             "lengths), batch (equal-length random prompts vs transformers), single, wide, prefill")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--traffic-requests", type=int, default=256,
                        help="requests of the traffic scenario, 4x max_num_seqs by default, so that the batch stays "
                             "full as in a server's traffic (it also runs --num-prompts requests, one batch's worth)")
    parser.add_argument("--wide", type=int, default=64, help="concurrent requests of the 'wide' scenario")
    parser.add_argument("--single-output-len", type=int, default=128)
    parser.add_argument("--prefill-prompts", type=int, default=16, help="prompts of the 'prefill' scenario")
    parser.add_argument("--prefill-len", type=int, default=1024, help="tokens per prompt of the 'prefill' scenario")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="dispatch each decode step before the previous step's tokens reach the host")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed passes of each scenario, for both engines, after a warm-up; the median is reported")
    parser.add_argument("--no-baseline", action="store_true", help="skip transformers")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads for the baseline")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    scenarios = set(args.scenarios.split(","))

    from benchmarks import traffic, workloads
    from jvllm import Engine
    from jvllm.worker.compile_watch import compile_watch

    started = time.perf_counter()
    options = {} if args.batched_weight_dtype is None else {"batched_weight_dtype": args.batched_weight_dtype}
    if args.quantization:
        options["quantization"] = args.quantization
    if args.attention_backend:
        options["attention_backend"] = args.attention_backend
    if args.speculative_config:
        options["speculative_config"] = json.loads(args.speculative_config)
    engine = Engine(args.model, dtype=args.dtype, load_format=args.load_format, kv_cache_dtype=args.kv_cache_dtype,
                    async_scheduling=args.async_scheduling, **options)
    cfg = engine.model.config
    results: dict = {
        "command": command_line("benchmarks.throughput", argv), "machine": machine_info(),
        "model": engine.served_model_name, "dtype": str(np.dtype(engine.model.dtype)),
        "quantization": args.quantization, "weight_bytes": engine.weight_bytes,
        "batched_weight_dtype": None if engine.runner.batched_weights is None else str(next(
            w.dtype for w in engine.runner.batched_weights if w.ndim == 2)),
        "attention_backend": engine.runner.backend.name, "kv_cache_dtype": str(engine.runner.kv_cache_dtype),
        "async_scheduling": engine.async_scheduling, "repeats": args.repeats,
        "step_shapes": len(engine.step_shapes()), "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "speculative_config": options.get("speculative_config"), "engine_start_seconds": time.perf_counter() - started,
    }
    print(f"engine start (precompile of {results['step_shapes']} step shapes included): "
          f"{results['engine_start_seconds']:.1f} s", flush=True)
    from jvllm.model_loader.loader import transformers_folder

    baseline = None if args.no_baseline else TransformersBaseline(
        transformers_folder(args.model), random_prompts(1, 8, cfg.vocab_size, 0), args.output_len, args.threads)
    if "chat" in scenarios:
        chat = results["chat"] = traffic.chat_vs_transformers(engine, baseline, args.num_prompts, args.output_len,
                                                              args.repeats)
        print(f"[chat] {args.num_prompts} chat prompts ({min(map(min, chat['prompt_lens']))}-"
              f"{max(map(max, chat['prompt_lens']))} tokens) x {args.output_len}: jvllm "
              f"{chat['jvllm']['output_tokens_per_s']:.1f} out tok/s", flush=True)
        if baseline is not None:
            print(f"[chat] transformers {chat['transformers']['output_tokens_per_s']:.1f} out tok/s -> jvllm is "
                  f"{chat['ratio_vs_transformers']:.2f}x (pass by pass: "
                  f"{', '.join(f'{r:.2f}x' for r in chat['pass_ratios'])})", flush=True)
    if "traffic" in scenarios:
        results["traffic"] = {}
        for num in sorted({args.traffic_requests, args.num_prompts}, reverse=True):
            total_in, total_out = num * args.input_len, num * args.output_len
            make = {"fixed": lambda seed, n=num: workloads.fixed(n, args.input_len, args.output_len, cfg.vocab_size,
                                                                 100 + seed),
                    "varied": lambda seed, n=num, i=total_in, o=total_out: workloads.varied(n, i, o, cfg.vocab_size,
                                                                                        200 + seed)}
            mix = results["traffic"][str(num)] = traffic.fixed_vs_varied(engine, make, args.repeats)
            print(f"[traffic] {num} requests: fixed ({args.input_len} in, {args.output_len} out) "
                  f"{mix['fixed']['output_tokens_per_s']:.1f} out tok/s, varied (prompts 16-1024, outputs 16-256, "
                  f"same totals) {mix['varied']['output_tokens_per_s']:.1f} -> varied/fixed "
                  f"{mix['varied_over_fixed']:.2f}", flush=True)
    if "batch" in scenarios:
        prompts = random_prompts(args.num_prompts, args.input_len, cfg.vocab_size, seed=0)
        if baseline is not None:
            baseline.use(prompts)
        batch = run_batch(engine, baseline, prompts, args.output_len, args.repeats)
        results["batch"] = {"num_prompts": args.num_prompts, "input_len": args.input_len,
                            "output_len": args.output_len, **batch}
        print(f"[batch] jvllm: {batch['jvllm']['output_tokens_per_s']:.1f} output tok/s, "
              f"{batch['jvllm']['requests_per_s']:.2f} req/s", flush=True)
        if "transformers" in batch:
            print(f"[batch] transformers: {batch['transformers']['output_tokens_per_s']:.1f} output tok/s -> jvllm "
                  f"is {batch['ratio_vs_transformers']:.2f}x (pass by pass: "
                  f"{', '.join(f'{r:.2f}x' for r in batch['pass_ratios'])})", flush=True)
    del baseline
    if "single" in scenarios:
        weight_bytes = sum(x.nbytes for x in engine.runner.step_weights.for_rows(1).leaves)  # a token's reads
        prompt = random_prompts(1, args.input_len, cfg.vocab_size, seed=0)[0]
        single = run_single_decode(engine, prompt, args.single_output_len, args.repeats, weight_bytes)
        results["single"] = single
        print(f"[single] decode {single['decode_tokens_per_s']:.1f} tok/s; bound {single['bound_tokens_per_s']:.1f} "
              f"tok/s ({weight_bytes / 1e6:.0f} MB weights / {single['bandwidth_gb_s']:.1f} GB/s, the fastest of "
              f"the probes {', '.join(f'{b:.1f}' for b in single['pass_bandwidth_gb_s'])}) -> "
              f"{100 * single['fraction_of_bound']:.0f}% of bound", flush=True)
    if "wide" in scenarios:
        wide_prompts = random_prompts(args.wide, args.input_len, cfg.vocab_size, seed=1)
        results["wide"] = {"num_prompts": args.wide,
                           "jvllm": run_jvllm(engine, wide_prompts, args.output_len, args.repeats)}
        print(f"[wide] {args.wide} concurrent: {results['wide']['jvllm']['output_tokens_per_s']:.1f} output tok/s",
              flush=True)
    if "prefill" in scenarios:
        prefill_prompts = random_prompts(args.prefill_prompts, args.prefill_len, cfg.vocab_size, seed=2)
        prefill = results["prefill"] = {"num_prompts": args.prefill_prompts, "prompt_len": args.prefill_len,
                                        **run_prefill(engine, prefill_prompts, args.repeats)}
        print(f"[prefill] {args.prefill_prompts} x {args.prefill_len} tokens: "
              f"{prefill['prompt_tokens_per_s']:.0f} prompt tok/s", flush=True)
    results["compilations_after_start"] = compile_watch().unexpected
    print(f"XLA compilations after start-up: {results['compilations_after_start']}", flush=True)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
