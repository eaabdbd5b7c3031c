"""Offline throughput: jvllm vs transformers' batched generate on the same prompt ids, in the same run.

Scenarios (all greedy, ignore_eos, fixed lengths, prefill included in the timing; each timed --repeats times
after a warm-up, the median reported):
  batch   N prompts x input-len tokens -> output-len tokens, jvllm and transformers, ratio printed; the two
          engines' timed passes alternate (jvllm, transformers, jvllm, ...), so a drift of the machine's speed
          during the run reaches both sides of the ratio
  single  one request's decode speed vs the memory-bandwidth bound (weight bytes / measured bandwidth)
  wide    64 concurrent requests, output tokens/s
"""
from __future__ import annotations

import argparse
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
    inputs, params = _warmed_inputs(engine, [prompt], output_len)
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
    """transformers' batched greedy `generate` (PyTorch, float32) on fixed prompt ids, one timed pass at a time."""

    def __init__(self, folder: str, prompts: list[list[int]], output_len: int, threads: int):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self._torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.ids = torch.tensor(prompts)
        self.kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                           attention_mask=torch.ones_like(self.ids), pad_token_id=0)

    def warm(self) -> None:
        """A short generate, so the first timed pass does not pay PyTorch's one-time setup."""
        ids = self.ids[:, :8]
        with self._torch.inference_mode():
            self.model.generate(ids, **{**self.kwargs, "max_new_tokens": 4, "min_new_tokens": 4,
                                        "attention_mask": self._torch.ones_like(ids)})

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


def hf_folder_for(model: str | None) -> str:
    """transformers reads the same weights: an HF folder as is, a GGUF through jvllm's converted cache."""
    from jvllm.model_loader.loader import _gguf_as_hf_folder, resolve_model_path

    path, _ = resolve_model_path(model)
    return str(_gguf_as_hf_folder(path)) if path.endswith(".gguf") else path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: embedded SmolLM2-135M-Instruct")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batched-weight-dtype", default="bfloat16",
                        help="weights for steps of >= 2 token rows (bf16 matmuls with f32 accumulation are faster on "
                             "CPU at many rows); 'none' keeps one float32 copy")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--wide", type=int, default=64, help="concurrent requests of the 'wide' scenario (0 = skip)")
    parser.add_argument("--single-output-len", type=int, default=128, help="0 skips the single-request scenario")
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

    import jax

    from jvllm import Engine

    started = time.perf_counter()
    engine = Engine(args.model, dtype=args.dtype, load_format=args.load_format,
                    max_num_seqs=max(args.num_prompts, args.wide, 1), max_model_len=4096,
                    batched_weight_dtype=None if args.batched_weight_dtype == "none" else args.batched_weight_dtype,
                    async_scheduling=args.async_scheduling)
    cfg = engine.model.config
    results: dict = {
        "command": command_line("benchmarks.throughput", argv), "machine": machine_info(),
        "model": engine.served_model_name, "dtype": str(np.dtype(engine.model.dtype)),
        "batched_weight_dtype": args.batched_weight_dtype, "async_scheduling": engine.async_scheduling,
        "repeats": args.repeats,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "engine_start_seconds": time.perf_counter() - started,
    }
    prompts = random_prompts(args.num_prompts, args.input_len, cfg.vocab_size, seed=0)
    baseline = None if args.no_baseline else TransformersBaseline(
        hf_folder_for(args.model), prompts, args.output_len, args.threads)
    batch = run_batch(engine, baseline, prompts, args.output_len, args.repeats)
    del baseline
    results["batch"] = {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                        **batch}
    print(f"[batch] jvllm: {batch['jvllm']['output_tokens_per_s']:.1f} output tok/s, "
          f"{batch['jvllm']['requests_per_s']:.2f} req/s", flush=True)
    if "transformers" in batch:
        print(f"[batch] transformers: {batch['transformers']['output_tokens_per_s']:.1f} output tok/s -> jvllm is "
              f"{batch['ratio_vs_transformers']:.2f}x (pass by pass: "
              f"{', '.join(f'{r:.2f}x' for r in batch['pass_ratios'])})", flush=True)
    if args.single_output_len:
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.model.state))
        single = run_single_decode(engine, prompts[0], args.single_output_len, args.repeats, weight_bytes)
        results["single"] = single
        print(f"[single] decode {single['decode_tokens_per_s']:.1f} tok/s; bound {single['bound_tokens_per_s']:.1f} "
              f"tok/s ({weight_bytes / 1e6:.0f} MB weights / {single['bandwidth_gb_s']:.1f} GB/s, the fastest of "
              f"the probes {', '.join(f'{b:.1f}' for b in single['pass_bandwidth_gb_s'])}) -> "
              f"{100 * single['fraction_of_bound']:.0f}% of bound (each pass against its own probe: "
              f"{', '.join(f'{100 * f:.0f}%' for f in single['pass_fractions_of_own_probe'])})", flush=True)
    if args.wide:
        wide_prompts = random_prompts(args.wide, args.input_len, cfg.vocab_size, seed=1)
        results["wide"] = {"num_prompts": args.wide,
                           "jvllm": run_jvllm(engine, wide_prompts, args.output_len, args.repeats)}
        print(f"[wide] {args.wide} concurrent: {results['wide']['jvllm']['output_tokens_per_s']:.1f} output tok/s",
              flush=True)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
