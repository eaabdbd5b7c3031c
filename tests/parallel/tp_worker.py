"""Tensor-parallel scenarios run in a subprocess with N virtual CPU devices; prints one JSON line.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/parallel/tp_worker.py SCENARIO 'JSON ARGS'

Scenarios: compare (TP=1 vs TP=N logits, greedy tokens, placement), hlo (collectives of the compiled decode
step), generate (greedy tokens of one engine), multihost (one rank of a multi-process mesh). `generate` and
`multihost` take token-id `prompts`, or `mm_prompts` of a vision-language model: [[text, [[seed, height, width] of
each random image]], ...]."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import sys
import time
from typing import Any

import numpy as np

RESULT_PREFIX = "TP_WORKER_RESULT "
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root, for tests.step_hlo


def engine(model: str | None, tp: int, **kwargs: Any):
    from jvllm import Engine

    # precompile=False: these checks compare outputs and collectives; compiling only the shapes they meet keeps
    # each engine's start short (tests/jvllm/test_no_compile.py covers precompiling)
    settings = dict(dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=128, max_num_seqs=8,
                    max_num_batched_tokens=256, enable_prefix_caching=False, attention_backend="xla",
                    precompile=False)
    settings.update(kwargs)
    return Engine(model, tensor_parallel_size=tp, **settings)


def greedy(eng, prompts: list[list[int] | dict], max_tokens: int) -> list[list[int]]:
    from jvllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts]
    outputs = eng.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def with_logprobs(eng, prompt: list[int]) -> dict[str, Any]:
    """Seeded sampling with sample and prompt logprobs: the tokens, and every logprob as one flat list."""
    from jvllm import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.8, seed=7, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = eng.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    values = [lp.logprob for entry in out.prompt_logprobs[1:] for lp in entry.values()]
    values += [lp.logprob for entry in out.outputs[0].logprobs for lp in entry.values()]
    return {"tokens": list(out.outputs[0].token_ids), "logprobs": values}


def constrained(eng, prompt: list[int]) -> dict[str, Any]:
    """Seeded sampling under a regex: the token mask is a replicated input of the sharded sampler."""
    from jvllm import SamplingParams, StructuredOutputsParams

    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5,
                            structured_outputs=StructuredOutputsParams(regex="[a-z ]{1,40}"))
    out = eng.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    return {"tokens": list(out.token_ids), "text": out.text}


def placement(eng) -> dict[str, Any]:
    """How the weights and the pool are laid out: the largest block any device holds vs the largest matrix."""
    weights = eng.runner.weights
    largest_block = max(s.data.size for w in weights for s in w.addressable_shards)
    largest_weight = max(w.size for w in weights)
    k_pages = eng.runner.kv_cache[0][0]
    return {"largest_block": int(largest_block), "largest_weight": int(largest_weight),
            "pool_shape": list(k_pages.shape), "pool_block": list(k_pages.addressable_shards[0].data.shape),
            "pool_spec": str(k_pages.sharding.spec), "num_pages": eng.config.num_pages,
            "num_kv_heads": eng.model.config.num_kv_heads}


def compare(args: dict[str, Any]) -> dict[str, Any]:
    """TP=1 against each TP size: logits of every prompt position (xla only) and greedy tokens; with `sampling`
    (the default), also seeded sampling with logprobs and a regex-constrained request (the sharded sampler)."""
    from tests.prompt_logits import prompt_logits

    prompts, max_tokens = args["prompts"], args.get("max_tokens", 8)
    backend = args.get("backend", "xla")
    overrides = args.get("engine", {})
    sampling = args.get("sampling", True)
    ref = engine(args["model"], 1, attention_backend=backend, **overrides)
    want_logits = [prompt_logits(ref.runner, p) for p in prompts] if backend == "xla" else None
    want_tokens = greedy(ref, prompts, max_tokens)
    out: dict[str, Any] = {"reference_tokens": want_tokens, "runs": {}}
    if sampling:
        want_sampled = with_logprobs(ref, prompts[0])
        out.update(reference_sampled=want_sampled["tokens"], reference_constrained=constrained(ref, prompts[0]))
    for tp in args["tps"]:
        eng = engine(args["model"], tp, attention_backend=backend, **overrides)
        run = {"tokens": greedy(eng, prompts, max_tokens), "placement": placement(eng)}
        if sampling:
            sampled = with_logprobs(eng, prompts[0])
            run["sampled_tokens"] = sampled["tokens"]
            run["constrained"] = constrained(eng, prompts[0])
            run["max_abs_logprob_diff"] = float(np.max(np.abs(np.subtract(sampled["logprobs"],
                                                                          want_sampled["logprobs"]))))
        if want_logits is not None:
            diffs = [float(np.max(np.abs(prompt_logits(eng.runner, p) - w))) for p, w in zip(prompts, want_logits)]
            run["max_abs_logit_diff"] = max(diffs)
            run["logit_scale"] = float(max(np.max(np.abs(w)) for w in want_logits))
        out["runs"][str(tp)] = run
    return out


_COLLECTIVE = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                         r"(-start)?\(")
_SHAPE = re.compile(r"[a-z]+\d*\[([\d,]*)\]")


def collectives(hlo: str) -> list[dict[str, Any]]:
    """Every collective of an HLO module: its op and result shapes."""
    found = []
    for line in hlo.splitlines():
        match = _COLLECTIVE.search(line)
        if match:
            shapes = [[int(d) for d in dims.split(",") if d] for dims in _SHAPE.findall(match.group(1))]
            found.append({"op": match.group(2), "shapes": shapes})
    return found


def hlo(args: dict[str, Any]) -> dict[str, Any]:
    """Compile a decode step (after one prefill) and the pool write; report their collectives (one layer's: the
    decode layers one per call)."""
    from jvllm import SamplingParams
    from jvllm.engine.step_plan import plan_chunks
    from jvllm.worker.layer_runs import LAYERS_PER_CALL_ENV

    os.environ[LAYERS_PER_CALL_ENV] = "1"

    eng = engine(args["model"], args["tp"], attention_backend=args.get("backend", "xla"))
    eng.add_request("r", {"prompt_token_ids": args["prompts"][0]}, SamplingParams(max_tokens=4, temperature=0.0))
    eng.step()  # the prefill; the next plan is one decode chunk
    call = eng.runner.step_call(plan_chunks(eng.scheduler.schedule()), "decode")
    from tests.step_hlo import compiled_step_hlo

    lowered = compiled_step_hlo(eng.runner, call)
    out = {piece: collectives(lowered[piece]) for piece in ("embed", "layer", "head")}
    out.update({"store_kv": collectives(lowered["store_kv"]) if "store_kv" in lowered else None,
                "joined_shards": joined_shards(eng),
                "weight_shapes": sorted({tuple(w.shape) for w in eng.runner.weights if w.ndim == 2}),
                "tokens": int(call.input_ids.shape[0]), "seqs": int(call.metadata.q_lens.shape[0]),
                "vocab": eng.model.config.vocab_size, "num_layers": eng.model.config.num_layers})
    return out


def joined_shards(eng) -> dict[str, list[int]]:
    """The column blocks of each joined q/k/v and gate/up projection (none where a layer kept them apart)."""
    from flax import nnx

    from models.layers import MLP
    from models.llama import Attention

    modules = [m for _, m in nnx.iter_modules(nnx.merge(eng.model.graphdef, eng.model.state))]
    return {"qkv": [m.joined_shards for m in modules if isinstance(m, Attention) and m.k_proj is None],
            "gate_up": [m.joined_shards for m in modules if isinstance(m, MLP) and m.up_proj is None]}


def prompts_of(args: dict[str, Any]) -> list[list[int] | dict]:
    """The scenario's prompts: token ids, or texts with random images (`mm_prompts`)."""
    if "mm_prompts" not in args:
        return args["prompts"]
    from tests.multimodal.helpers import random_image

    return [{"prompt": text, "multi_modal_data": {"image": [random_image(seed, (h, w)) for seed, h, w in images]}}
            for text, images in args["mm_prompts"]]


def encoder_buffer_digest(eng) -> str | None:
    """A hash of this host's copy of the encoder buffer (vision-language models): equal on every rank that ran the
    same encoder steps."""
    from jvllm.parallel.mesh import host_array

    encoder = eng.runner.encoder
    return None if encoder is None else hashlib.sha256(host_array(encoder.buffer).tobytes()).hexdigest()


def generate(args: dict[str, Any]) -> dict[str, Any]:
    eng = engine(args["model"], args.get("tp", 1), attention_backend=args.get("backend", "xla"),
                 **args.get("engine", {}))
    return {"tokens": greedy(eng, prompts_of(args), args.get("max_tokens", 8))}


def multihost(args: dict[str, Any]) -> dict[str, Any]:
    """One rank of a num_hosts-process mesh: rank 0 generates (and reads logits), the others follow."""
    import jax

    from tests.prompt_logits import prompt_logits

    eng = engine(args["model"], args["tp"], num_hosts=args["num_hosts"], host_rank=args["rank"],
                 coordinator=args["coordinator"], **args.get("engine", {}))
    out: dict[str, Any] = {"rank": jax.process_index(), "devices": jax.device_count(),
                           "local_devices": jax.local_device_count()}
    if eng.is_leader:
        out["tokens"] = greedy(eng, prompts_of(args), args.get("max_tokens", 8))
        if "prompts" in args:
            out["logits_row0"] = prompt_logits(eng.runner, args["prompts"][0])[-1, :8].tolist()
        if args.get("idle_s"):  # followers wait inside a collective while rank 0 is idle
            time.sleep(args["idle_s"])
            out["tokens_after_idle"] = greedy(eng, args["prompts"][:1], args.get("max_tokens", 8))
        eng.shutdown()
    else:
        out["steps_followed"] = eng.follow()
    out["encoder_buffer"] = encoder_buffer_digest(eng)
    return out


SCENARIOS = {"compare": compare, "hlo": hlo, "generate": generate, "multihost": multihost}


def main() -> None:
    import jax

    scenario, args = sys.argv[1], json.loads(sys.argv[2])
    started = time.perf_counter()
    if scenario != "multihost" and jax.device_count() < args.get("devices", 1):
        raise SystemExit(f"needs {args['devices']} devices, found {jax.device_count()} (set XLA_FLAGS)")
    result = SCENARIOS[scenario](args)
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
