"""Time to first token of an image prompt, first time and repeated, on a tiny random LLaVA-1.5, Qwen2-VL or
Qwen2.5-VL: the repeated image's encoder output comes from the encoder cache. Prints both medians and their ratio;
--json writes them.

The model is built with transformers (random weights, saved to a temporary folder; --family picks it) unless --model
names a vision-language folder. LLaVA: a CLIP tower with LLaVA-1.5's geometry (336 x 336 pixels in 14-pixel
patches: 576 image tokens) but narrow layers, and a small Llama. Qwen2-VL and Qwen2.5-VL: their vision transformer
(Qwen2.5-VL's windowed) with the real patch geometry and image processor (the 400 x 500 test images become 28 x 36
patches, 252 tokens) but narrow layers, and a small Qwen2 language model with M-RoPE. Prefix caching is off by
default, and each request's text differs, so the repeated request saves exactly the encoder work (--prefix-caching
measures the default engine, where the repeat also reuses the prompt's KV pages)."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import command_line, machine_info, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def build_tiny_llava(folder: str, vision_hidden: int, vision_layers: int) -> None:
    """Save a random LLaVA (SmolLM2's tokenizer plus <image>, CLIP processor at 336 px) into `folder`."""
    import torch
    import transformers

    from jvllm.model_loader.default_model import default_model_path
    from jvllm.model_loader.gguf import gguf_tokenizer

    tokenizer = gguf_tokenizer(default_model_path())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = transformers.CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=4 * vision_hidden,
                                           num_hidden_layers=vision_layers, num_attention_heads=vision_hidden // 64,
                                           image_size=336, patch_size=14)
    text = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                      image_token_index=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    transformers.CLIPImageProcessorPil(size={"shortest_edge": 336},
                                       crop_size={"height": 336, "width": 336}).save_pretrained(folder)


def build_tiny_qwen_vl(folder: str, vision_hidden: int, vision_layers: int, family: str = "Qwen2VL") -> None:
    """Save a random Qwen2-VL or (family "Qwen2_5_VL") Qwen2.5-VL: SmolLM2's tokenizer plus the vision tokens,
    Qwen2-VL's default image processor (both families use it)."""
    import torch
    import transformers

    from jvllm.model_loader.default_model import default_model_path
    from jvllm.model_loader.gguf import gguf_tokenizer

    tokenizer = gguf_tokenizer(default_model_path())
    start, end, pad = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
    tokenizer.add_special_tokens({"additional_special_tokens": [start, end, pad]})
    text = dict(vocab_size=len(tokenizer) + 1, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1,
                eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]})
    if family == "Qwen2VL":
        vision = dict(depth=vision_layers, embed_dim=vision_hidden, hidden_size=128, num_heads=vision_hidden // 64,
                      mlp_ratio=4)
    else:  # Qwen2.5-VL's layout: windows of 112 pixels, full attention in every fourth block as in the real ones
        vision = dict(depth=vision_layers, hidden_size=vision_hidden, out_hidden_size=128,
                      intermediate_size=2 * vision_hidden, num_heads=vision_hidden // 64, window_size=112,
                      fullatt_block_indexes=list(range(3, vision_layers, 4)))
    ids = tokenizer.convert_tokens_to_ids([start, end, pad])
    config = getattr(transformers, f"{family}Config")(
        text_config=text, vision_config=vision, vision_start_token_id=ids[0], vision_end_token_id=ids[1],
        image_token_id=ids[2], video_token_id=len(tokenizer))
    torch.manual_seed(0)
    getattr(transformers, f"{family}ForConditionalGeneration")(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    transformers.Qwen2VLImageProcessorPil().save_pretrained(folder)


BUILDERS = {"llava": build_tiny_llava, "qwen2_vl": build_tiny_qwen_vl,
            "qwen2_5_vl": lambda folder, hidden, layers: build_tiny_qwen_vl(folder, hidden, layers, "Qwen2_5_VL")}


def image(seed: int):
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (400, 500, 3), dtype=np.uint8))


def ttft(engine, text: str, picture) -> float:
    """Seconds from submitting the prompt to its first token (prefill and one sampled token)."""
    from jvllm import SamplingParams

    started = time.perf_counter()
    engine.generate({"prompt": text, "multi_modal_data": {"image": picture}}, SamplingParams(max_tokens=1),
                    use_tqdm=False)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a vision-language folder (default: a tiny random one of "
                        "--family, built here)")
    parser.add_argument("--family", choices=sorted(BUILDERS), default="llava", help="the tiny model's family")
    parser.add_argument("--vision-hidden", type=int, default=512, help="the tiny model's vision tower width")
    parser.add_argument("--vision-layers", type=int, default=8, help="the tiny model's vision tower layers")
    parser.add_argument("--rounds", type=int, default=5, help="new images timed (each followed by its repeat)")
    parser.add_argument("--prefix-caching", action="store_true", help="keep prefix caching on (and the text equal)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    from jvllm import Engine

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model
        if folder is None:
            folder = tmp
            BUILDERS[args.family](folder, args.vision_hidden, args.vision_layers)
        started = time.perf_counter()
        engine = Engine(folder, dtype="float32", max_num_seqs=8, max_num_batched_tokens=1024,
                        enable_prefix_caching=args.prefix_caching)
        start_seconds = time.perf_counter() - started
        vision = engine.model.vision
        slot = vision.image_token  # one image's placeholder text
        ttft(engine, f"USER: {slot}\nWarm-up. ASSISTANT:", image(10_000))  # first call of each piece
        first, repeated = [], []
        for index in range(args.rounds):
            picture = image(index)
            words = "" if args.prefix_caching else f" Round {index}, first look."
            first.append(ttft(engine, f"USER: {slot}\nDescribe the picture.{words} ASSISTANT:", picture))
            words = "" if args.prefix_caching else f" Round {index}, second look."
            repeated.append(ttft(engine, f"USER: {slot}\nDescribe the picture.{words} ASSISTANT:", picture))
        cache = engine.encoder_cache
        image_tokens = engine.mm_processor.process_image(image(0)).num_tokens
    tiny = {"llava": f"tiny random LLaVA (CLIP {args.vision_layers} x {args.vision_hidden}, 336 px / 14)",
            "qwen2_vl": f"tiny random Qwen2-VL (ViT {args.vision_layers} x {args.vision_hidden}, 14 px patches)",
            "qwen2_5_vl": f"tiny random Qwen2.5-VL (windowed ViT {args.vision_layers} x {args.vision_hidden}, 14 px "
                          "patches)"}
    results = {
        "command": command_line("benchmarks.multimodal", argv), "machine": machine_info(),
        "model": args.model or tiny[args.family], "image_tokens": image_tokens, "prefix_caching": args.prefix_caching,
        "engine_start_seconds": start_seconds, "first_ttft_seconds": first, "repeated_ttft_seconds": repeated,
        "first_ttft_median_seconds": statistics.median(first),
        "repeated_ttft_median_seconds": statistics.median(repeated),
        "encoder_cache_queries": cache.queries, "encoder_cache_hits": cache.hits,
    }
    results["ttft_ratio"] = results["first_ttft_median_seconds"] / results["repeated_ttft_median_seconds"]
    print(f"{results['model']}: {image_tokens} image tokens, prefix caching "
          f"{'on' if args.prefix_caching else 'off'}")
    print(f"TTFT, new image: median {1000 * results['first_ttft_median_seconds']:.1f} ms; repeated image (encoder "
          f"cache hit): median {1000 * results['repeated_ttft_median_seconds']:.1f} ms; ratio "
          f"{results['ttft_ratio']:.2f}x ({cache.hits} hits of {cache.queries} lookups)")
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
