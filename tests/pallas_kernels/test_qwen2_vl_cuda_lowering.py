"""Qwen2-VL and Qwen2.5-VL engines' steps lower for CUDA on a CPU-only machine (jax 0.10.2 and 0.12): the embedding
with M-RoPE positions [3, T] and image rows, a layer with the Pallas attention kernel, and every packed encoder step
(plain XLA, the encoder buffer donated). Dummy bfloat16 weights of a tiny config; no torch needed, nothing runs."""
from __future__ import annotations

import pytest

from jvllm import Engine
from pallas_kernels.cuda_lowering import TRITON_CALL, lower_jitted_for_cuda, triton_kernels
from pallas_kernels.variants import KERNEL_NAMES
from tests.multimodal.qwen2_vl_helpers import (IMAGE_PAD_ID, IMAGE_PROCESSOR, QWEN2VL_TEXT, QWEN2VL_VISION,
                                               QWEN25VL_VISION, VIDEO_PAD_ID, VISION_END_ID, VISION_START_ID,
                                               qwen2_vl_tokenizer)
from tests.pallas_kernels.test_pallas_engine_lowering import donated_arguments

pytestmark = pytest.mark.filterwarnings("ignore:.*[Tt]riton.*")


FAMILIES = {"Qwen2VL": QWEN2VL_VISION, "Qwen2_5_VL": QWEN25VL_VISION}  # transformers' class prefix -> vision config


@pytest.fixture(scope="module", params=list(FAMILIES))
def engine(request, tmp_path_factory) -> Engine:
    import transformers

    family = request.param
    folder = tmp_path_factory.mktemp(f"{family}-dummy")
    config = getattr(transformers, f"{family}Config")(
        text_config=QWEN2VL_TEXT, vision_config=FAMILIES[family], image_token_id=IMAGE_PAD_ID,
        video_token_id=VIDEO_PAD_ID, vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID)
    config.architectures = [f"{family}ForConditionalGeneration"]
    config.save_pretrained(folder)
    qwen2_vl_tokenizer().save_pretrained(folder)
    transformers.Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR).save_pretrained(folder)
    return Engine(str(folder), load_format="dummy", dtype="bfloat16", attention_backend="pallas", max_model_len=128,
                  max_num_seqs=4, kv_cache_memory_bytes=1 << 20, precompile=False)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_model_step_pieces_with_mrope_positions_lower_for_cuda(engine, kind, monkeypatch):
    monkeypatch.setenv("JVLLM_PALLAS_INTERPRET", "0")
    runner = engine.runner
    shape = max(s for s in engine.step_shapes() if s.kind == kind)
    md, ids, positions, _, _, mm_rows = runner.compiled._examples(shape)
    assert positions.shape == (3, shape.tokens) and mm_rows.shape == (shape.tokens,)
    steps, weights = runner.compiled.steps, runner.step_weights.for_rows(shape.tokens)
    embed = lower_jitted_for_cuda(steps.embed, weights.outer, ids, positions, mm_rows, runner.encoder.buffer)
    x, cos, sin = embed.out_info
    assert cos.shape == (shape.tokens, engine.model.config.head_dim)
    layer = lower_jitted_for_cuda(steps.layer, weights.layers[0], x, cos, sin, runner.kv_cache[0], md)
    assert [kernel.name for kernel in triton_kernels(layer)] == [KERNEL_NAMES["decode" if kind == "decode" else
                                                                             "ragged"]]
    assert TRITON_CALL not in embed.as_text()


def test_packed_encoder_steps_lower_for_cuda(engine):
    encoder = engine.runner.encoder
    shapes = encoder.step_shapes()
    assert [s.tokens for s in shapes] == [16]  # the tiny processor's largest image: 4 x 4 tokens
    buffer_type = "tensor<{}x{}xbf16>".format(*encoder.buffer.shape)
    for shape in shapes:
        lowered = lower_jitted_for_cuda(encoder._encode_into, encoder.weights, encoder.buffer,
                                        *encoder.input_specs(shape))
        text = lowered.as_text()
        assert TRITON_CALL not in text
        assert donated_arguments(text) == {buffer_type: [0]}  # the buffer is updated in place
