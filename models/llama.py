"""Flax NNX Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2, and the mixtures of experts Mixtral,
Qwen2-MoE and Qwen3-MoE) reading and writing the paged KV pool."""
from __future__ import annotations

from typing import Callable, Container, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import AttentionMetadata, KVCache, LayerAttention, attention_mesh, value_dtype
from models.bf16_rows import bf16_rows_dot
from models.config import ModelConfig
from models.layers import MLP, Linear, RMSNorm, merge_output_columns, mlp_hf_parameters, split_columns
from models.hf_names import ArraySource, DerivedTensors, TensorSource, row_range
from models.moe import SparseMoE
from models.params import normal_param, value_or_none
from models.quantized import (CHANNEL_FORMATS, check_quantized, dequantized_rows, native_kernel_available,
                              native_layout, quantized_dot)
from models.rope import apply_rotary, attention_factor, inverse_frequencies, mrope_rotary_tables, rotary_tables

LayerResults = list  # per layer: what the attention call returned beside its output
EmbedLookup = Callable[[jax.Array, jax.Array], jax.Array]  # (table [V, D], ids [T]) -> [T, D]
# (parameter, HF tensor name, stored transposed vs. the HF tensor, logical axis of each dimension)
HFParameter = tuple[nnx.Param, str, bool, tuple[str | None, ...]]


class Attention(nnx.Module):
    """Self-attention of layer `index`: its sliding window, RoPE table (Gemma 3 has two) and q/k norm class
    come from the config."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None, index: int = 0,
                 norm: type[nnx.Module] = RMSNorm):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(d, cfg.num_heads * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(cfg.num_heads * hd, d, bias=cfg.o_bias, dtype=dtype, rngs=rngs)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.sliding_window = cfg.layer_window(index)
        self.scale, self.soft_cap = cfg.attention_scale, cfg.attn_logit_softcap
        # with a local RoPE base, cos/sin come stacked [global, local]: full layers take 0, sliding ones 1
        self.rope_table = None if cfg.local_rope_theta is None else int(self.sliding_window is not None)
        self.q_norm = norm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = norm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.joined_shards = 1  # q, k and v joined (fuse_qkv): their columns' blocks (merge_output_columns)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, pages: tuple[jax.Array, jax.Array],
                 md: AttentionMetadata, attention: LayerAttention) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """x [T, D] -> (out [T, D], the attention call's per-layer result)."""
        tokens = x.shape[0]
        if self.rope_table is not None:
            cos, sin = cos[self.rope_table], sin[self.rope_table]
        q, k, v = self._rotated_qkv(x, cos, sin)
        out, layer_kv = attention(q, k, v, pages, md, self.scale, self.sliding_window, self.soft_cap)  # [T, H, hd]
        return self.o_proj(out.reshape(tokens, -1)), layer_kv

    def _rotated_qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, D] -> q [T, H, hd] and k [T, KVH, hd] normed (with q/k norms) and rotated, and v [T, KVH, hd]."""
        tokens = x.shape[0]
        if self.k_proj is None:  # q, k and v as one projection (fuse_qkv): columns [q | k | v]
            qkv = self.q_proj(x)
            if self._native_rope(qkv, cos):
                from cpu_kernels.rope import rope_qkv

                return rope_qkv(qkv, cos, sin, self.num_heads, self.num_kv_heads)
            q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = split_columns(qkv, (q_width, kv_width, kv_width), self.joined_shards)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(tokens, self.num_heads, self.head_dim)  # [T, H, hd]
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, hd]
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, hd]
        if self.q_norm is not None:
            q, k = self.q_norm(q).astype(q.dtype), self.k_norm(k).astype(k.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def _native_rope(self, qkv: jax.Array, cos: jax.Array) -> bool:
        """Whether q, k and v come from the joined projection's output in one native pass (cpu_kernels.rope, XLA
        CPU): float32 columns [q | k | v] of one device, no q/k norm between, tables [T, rotary] of even width."""
        return (jax.default_backend() == "cpu" and self.joined_shards == 1 and self.q_norm is None
                and qkv.dtype == jnp.float32 and cos.dtype == jnp.float32 and cos.ndim == 2
                and cos.shape[-1] % 2 == 0 and cos.shape[-1] <= self.head_dim and native_kernel_available())

    def fuse_qkv(self) -> bool:
        """Hold q, k and v as one projection where all three hold the same kind of weights
        (models.layers.merge_output_columns): q_proj then computes them together (output columns [q | k | v], or
        under tensor parallelism [q | k | v] of each device's heads side by side) and k_proj, v_proj are None. For
        weights already loaded. -> whether fused."""
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        shards = 0 if k is None or v is None else merge_output_columns([q, k, v])
        if not shards:
            return False
        self.k_proj = self.v_proj = None
        self.joined_shards = shards
        return True


def fuse_projections(module: nnx.Module) -> tuple[int, int]:
    """Attention.fuse_qkv and MLP.fuse_gate_up on every layer of a loaded model -> (attention layers fused, MLPs
    fused)."""
    modules = [m for _, m in nnx.iter_modules(module)]
    return (sum(m.fuse_qkv() for m in modules if isinstance(m, Attention)),
            sum(m.fuse_gate_up() for m in modules if isinstance(m, MLP)))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        sparse = cfg.moe is not None and cfg.moe.sparse_layers[index]
        self.mlp: MLP | SparseMoE = (SparseMoE(cfg.hidden_size, cfg.moe, dtype, rngs) if sparse
                                     else MLP(cfg.hidden_size, cfg.intermediate_size, dtype, rngs))

    def __call__(self, x, cos, sin, pages, md, attention):
        x, mlp_out, new_kv = self.call_deferred(x, None, cos, sin, pages, md, attention)
        return x + mlp_out, new_kv

    def defers_residual(self, x: jax.Array) -> bool:
        """Whether call_deferred saves a pass here: the input norm adds the previous layer's output natively."""
        return self.input_layernorm.adds_natively(x)

    def call_deferred(self, x, delta, cos, sin, pages, md, attention):
        """The layer with its residual adds left to its neighbours: x plus `delta` (the previous layer's MLP output,
        added in the input norm's pass; None: nothing to add) -> (x, this layer's MLP output, new_kv), whose sum is
        what __call__ returns."""
        if delta is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_and_norm(x, delta)
        attn_out, new_kv = self.self_attn(h, cos, sin, pages, md, attention)
        x, h = self.post_attention_layernorm.add_and_norm(x, attn_out)
        mlp_out = self.mlp(h, attention_mesh(attention)) if isinstance(self.mlp, SparseMoE) else self.mlp(h)
        return x, mlp_out.astype(x.dtype), new_kv


class LlamaForCausalLM(nnx.Module):
    """Per-layer weights in a Python list. The engine calls `embed`, each layer and `finish` as separate jitted
    steps (one compiled layer serves all of them); `__call__` chains them in one trace."""

    layer_class: type[nnx.Module] = DecoderLayer  # (cfg, index, dtype, rngs) -> one decoder layer
    norm_class: type[nnx.Module] = RMSNorm  # the final norm

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.config = cfg
        self.embed_tokens = normal_param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)
        self.layers = nnx.List([self.layer_class(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else normal_param(
            rngs, (cfg.hidden_size, cfg.vocab_size), dtype)
        self.embed_quant: str | None = None  # a models.quantized format: the table holds GGUF blocks [V, row bytes]
        self.head_quant: str | None = None  # the same for an untied LM head
        self.embed_scale: nnx.Param | None = None  # per-channel formats (codes [V, D]): a scale per row, [V]
        self.head_scale: nnx.Param | None = None

    def _check_quantized(self, blocks: jax.Array, fmt: str, scale: jax.Array | None, what: str) -> nnx.Param | None:
        """ValueError unless `blocks` (and `scale`) hold a [V, D] table in format `fmt`; -> the scale's Param."""
        if check_quantized(blocks, scale, self.config.vocab_size, self.config.hidden_size, fmt, what):
            return nnx.data(nnx.Param(scale))  # data, though the attribute was a static None
        return None

    def set_quantized_embedding(self, blocks: jax.Array, fmt: str, scale: jax.Array | None = None) -> None:
        """Hold the embedding table (and, tied, the LM head) as GGUF blocks [V, row bytes] of format `fmt`, or as
        per-channel codes [V, D] with `scale` [V]."""
        self.embed_scale = self._check_quantized(blocks, fmt, scale, "the embedding table")
        if fmt not in CHANNEL_FORMATS:
            blocks, fmt = native_layout(blocks, fmt, table=True)
        self.embed_tokens = nnx.Param(blocks)
        self.embed_quant = fmt

    def set_quantized_head(self, blocks: jax.Array, fmt: str, scale: jax.Array | None = None) -> None:
        """Hold an untied LM head as GGUF blocks [V, row bytes] of format `fmt` (one row per token), or as
        per-channel codes [V, D] with `scale` [V]."""
        if self.lm_head is None:
            raise ValueError("the model ties its LM head to the embedding table")
        self.head_scale = self._check_quantized(blocks, fmt, scale, "the LM head")
        self.lm_head = nnx.Param(blocks)
        self.head_quant = fmt

    @property
    def embedding_dtype(self) -> jnp.dtype:
        """The dtype the table's rows come out in (float32 for GGUF blocks)."""
        return jnp.dtype(jnp.float32) if self.embed_quant else self.embed_tokens[...].dtype

    def embedding_rows(self, table: jax.Array, input_ids: jax.Array) -> jax.Array:
        """Rows `input_ids` [T] of the table -> [T, D]."""
        if self.embed_quant is None:
            return table[input_ids]
        return dequantized_rows(table, input_ids, self.embed_quant, self.config.hidden_size,
                                value_or_none(self.embed_scale))

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_cache: KVCache, md: AttentionMetadata,
                 attention: LayerAttention, embed: EmbedLookup | None = None) -> tuple[jax.Array, LayerResults]:
        """input_ids, positions [T] int32 -> (final hidden states [T, D], each layer's new (k, v)).
        `embed` replaces the table lookup (tensor parallelism: a vocab-parallel lookup).

        Activations take the dtype of the KV pool's values, whatever the weights' dtype (see ModelRunner's
        batched weights). Each layer's K/V result is the new K/V (split backends: the runner writes it into the pool
        in a separate donated jit) or the updated pages (fused backends)."""
        x, cos, sin = self.embed(input_ids, positions, value_dtype(kv_cache[0][0].dtype), embed)
        new_kv: LayerResults = []
        for layer, pages in zip(self.layers, kv_cache):
            x, layer_kv = layer(x, cos, sin, pages, md, attention)
            new_kv.append(layer_kv)
        return self.finish(x), new_kv

    def embed(self, input_ids: jax.Array, positions: jax.Array, activation_dtype: jnp.dtype,
              embed: EmbedLookup | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """input_ids [T], positions [T] int32 ([3, T] with multimodal RoPE) -> (x [T, D], the RoPE tables cos, sin
        [T, hd]) for the layers."""
        table = self.embed_tokens[...]
        if embed is not None and self.embed_quant is not None:
            raise ValueError("a quantized embedding table runs on one device")
        x = (self.embedding_rows(table, input_ids) if embed is None else embed(table, input_ids))  # [T, D]
        x = x.astype(activation_dtype)
        cfg = self.config  # static: the frequencies become trace-time constants, not state
        inv_freq = inverse_frequencies(cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
        if positions.ndim == 2:  # M-RoPE; plain positions [T] are text, the same on all three axes
            cos, sin = mrope_rotary_tables(positions, inv_freq, cfg.mrope_section)  # [T, hd] each
        else:
            cos, sin = rotary_tables(positions, inv_freq, attention_factor(cfg.rope_scaling_dict))  # [T, hd] each
        return x, cos, sin

    def finish(self, x: jax.Array) -> jax.Array:
        """The last layer's output [T, D] -> the final hidden states (normalized, in the activation dtype)."""
        return self.norm(x).astype(x.dtype)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [S, D] -> logits [S, V] float32."""
        if self.lm_head is None:
            table = self.embed_tokens[...]
            if self.embed_quant is not None:
                return quantized_dot(hidden, table, self.embed_quant, value_or_none(self.embed_scale))
            native = bf16_rows_dot(hidden, table, out_in=True)  # CPU steps of 1-4 rows with a bf16 table
            if native is not None:
                return native
            return jnp.einsum("sd,vd->sv", hidden.astype(table.dtype), table, preferred_element_type=jnp.float32)
        head = self.lm_head[...]
        if self.head_quant is not None:
            return quantized_dot(hidden, head, self.head_quant, value_or_none(self.head_scale))
        native = bf16_rows_dot(hidden, head, out_in=False)
        if native is not None:
            return native
        return jnp.einsum("sd,dv->sv", hidden.astype(head.dtype), head, preferred_element_type=jnp.float32)

    def hf_parameters(self, available: Container[str]) -> Iterator[HFParameter]:
        """Every parameter with its HF tensor name (torch layout: Linear weights are [out, in]) and the
        logical axes that tensor parallelism shards (see jvllm.parallel.mesh.LOGICAL_AXIS_RULES)."""
        yield from self.outer_hf_parameters(available)
        mixtral = self.config.architecture.startswith("Mixtral")
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            yield layer.input_layernorm.weight, prefix + "input_layernorm.weight", False, ("embed",)
            yield layer.post_attention_layernorm.weight, prefix + "post_attention_layernorm.weight", False, ("embed",)
            yield from attention_hf_parameters(layer.self_attn, prefix + "self_attn.", self.config.fused_projections)
            if self.config.fused_projections:
                yield from _fused_mlp_hf_parameters(layer.mlp, prefix + "mlp.")
            elif isinstance(layer.mlp, SparseMoE):
                projections = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
                yield from layer.mlp.hf_parameters(prefix + ("block_sparse_moe." if mixtral else "mlp."), projections)
            else:
                yield from mlp_hf_parameters(layer.mlp, prefix + "mlp.")

    def outer_hf_parameters(self, available: Container[str]) -> Iterator[HFParameter]:
        """The embedding table, the final norm and (untied) the LM head."""
        yield self.embed_tokens, "model.embed_tokens.weight", False, ("vocab", "embed")
        yield self.norm.weight, "model.norm.weight", False, ("embed",)
        if self.lm_head is not None:
            name = "lm_head.weight" if "lm_head.weight" in available else "model.embed_tokens.weight"
            yield self.lm_head, name, True, ("embed", "vocab")

    def load_hf_weights(self, tensors: Mapping[str, np.ndarray] | TensorSource, dtype: jnp.dtype,
                        matrix_dtype: jnp.dtype | None = None) -> None:
        """Fill every parameter from HF-named tensors (whole, on the default device), read one at a time from a
        TensorSource or taken from a dict. `matrix_dtype`: the dtype of the weight matrices (norms and biases keep
        `dtype`; None: `dtype` for all)."""
        source = DerivedTensors(ArraySource(dict(tensors)) if isinstance(tensors, Mapping) else tensors,
                                self.config.moe.num_experts if self.config.moe else 0)
        for param, name, transpose, _ in self.hf_parameters(source):
            if name not in source:
                raise ValueError(f"weights are missing tensor {source.source_name(name)!r}")
            array = source.whole(name)
            wanted = dtype if matrix_dtype is None or array.ndim < 2 else matrix_dtype
            param.set_value(jnp.asarray(array.T if transpose else array, dtype=wanted))


def attention_hf_parameters(attn: Attention, prefix: str, fused: bool) -> Iterator[HFParameter]:
    """q/k/v split by output columns (heads), o by input rows; biases and per-head norms where present. `fused`:
    q, k and v are row ranges of one qkv_proj tensor."""
    if attn.k_proj is None:
        raise ValueError("q, k and v were fused after loading (Attention.fuse_qkv): their HF tensors are gone")
    q_rows, kv_rows = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    fused_rows = {"q_proj": (0, q_rows), "k_proj": (q_rows, q_rows + kv_rows),
                  "v_proj": (q_rows + kv_rows, q_rows + 2 * kv_rows)}
    for name, axis in (("q_proj", "heads"), ("k_proj", "kv_heads"), ("v_proj", "kv_heads")):
        proj: Linear = getattr(attn, name)
        weight = row_range(prefix + "qkv_proj.weight", *fused_rows[name]) if fused else prefix + name + ".weight"
        yield proj.kernel, weight, True, ("embed", axis)
        if proj.bias is not None:
            yield proj.bias, prefix + name + ".bias", False, (axis,)
    yield attn.o_proj.kernel, prefix + "o_proj.weight", True, ("heads", "embed")
    if attn.o_proj.bias is not None:
        yield attn.o_proj.bias, prefix + "o_proj.bias", False, ("embed",)
    for name in ("q_norm", "k_norm"):
        norm: RMSNorm | None = getattr(attn, name)
        if norm is not None:
            yield norm.weight, prefix + name + ".weight", False, ("head_dim",)


def _fused_mlp_hf_parameters(mlp: MLP, prefix: str) -> Iterator[HFParameter]:
    """gate and up as the two row halves of one gate_up_proj tensor (Phi-3), down as usual."""
    width = mlp.gate_proj.d_out
    yield mlp.gate_proj.kernel, row_range(prefix + "gate_up_proj.weight", 0, width), True, ("embed", "mlp")
    yield mlp.up_proj.kernel, row_range(prefix + "gate_up_proj.weight", width, 2 * width), True, ("embed", "mlp")
    yield mlp.down_proj.kernel, prefix + "down_proj.weight", True, ("mlp", "embed")
