"""Flax NNX Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) reading and writing the paged KV pool."""
from __future__ import annotations

from typing import Callable, Container, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import AttentionMetadata, KVCache, LayerAttention, value_dtype
from models.config import ModelConfig
from models.params import normal_param
from models.rope import apply_rotary, inverse_frequencies, rotary_tables

LayerResults = list  # per layer: what the attention call returned beside its output
EmbedLookup = Callable[[jax.Array, jax.Array], jax.Array]  # (table [V, D], ids [T]) -> [T, D]
# (parameter, HF tensor name, stored transposed vs. the HF tensor, logical axis of each dimension)
HFParameter = tuple[nnx.Param, str, bool, tuple[str | None, ...]]


# Up to this many token rows, a kernel stored [out, in] is applied as (kernel @ x^T)^T, which XLA CPU runs faster
# at few rows; more rows contract x with it directly (docs/design.md).
OUT_IN_TRANSPOSED_DOT_MAX_ROWS = 64


def stored_out_in(d_in: int, d_out: int) -> bool:
    """Whether the batched CPU weight copy keeps a d_in -> d_out kernel as [out, in]: the projections that
    narrow (down_proj, and k/v_proj under GQA), which XLA CPU multiplies faster that way (docs/design.md)."""
    return d_in > d_out


def out_in_kernel_leaves(state: nnx.State) -> list[bool]:
    """Per leaf of a Llama state, in jax.tree.flatten order: whether it is a Linear kernel [in, out] that the
    batched copy stores [out, in]."""
    return [getattr(path[-2], "key", None) == "kernel" and leaf.ndim == 2 and stored_out_in(*leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]]


class Linear(nnx.Module):
    """y = x @ kernel (+ bias), accumulation in float32. The kernel is [in, out], or [out, in] in the runner's
    batched copy when `stored_out_in` (told apart by shape: such a kernel is never square)."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.kernel = normal_param(rngs, (d_in, d_out), dtype)
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None
        self.d_in, self.d_out = d_in, d_out

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        # Cast the activation to the weight dtype, never the weights up: bf16 weights with f32 activations
        # must stay a bf16 x bf16 -> f32 dot (the fast CPU path), not a per-step f32 copy of the weights.
        xk = x.astype(kernel.dtype)  # [T, in]
        if self.d_in != self.d_out and kernel.shape == (self.d_out, self.d_in):
            y = _dot_out_in(xk, kernel)
        else:
            y = jnp.einsum("td,de->te", xk, kernel, preferred_element_type=jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


def _dot_out_in(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [T, in] with kernel [out, in] -> [T, out] float32."""
    contract_in = (((1,), (1,)), ((), ()))
    if 1 < x.shape[0] <= OUT_IN_TRANSPOSED_DOT_MAX_ROWS:
        y_t = jax.lax.dot_general(kernel, x, contract_in, preferred_element_type=jnp.float32)  # [out, T]
        return jax.lax.optimization_barrier(y_t).T  # the barrier stops XLA folding the transpose back into the dot
    return jax.lax.dot_general(x, kernel, contract_in, preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)  # transformers' order; f32 when the weight is bf16


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(d, cfg.num_heads * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(cfg.num_heads * hd, d, bias=cfg.o_bias, dtype=dtype, rngs=rngs)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.sliding_window = cfg.sliding_window

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, pages: tuple[jax.Array, jax.Array],
                 md: AttentionMetadata, attention: LayerAttention) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """x [T, D] -> (out [T, D], the attention call's per-layer result)."""
        tokens = x.shape[0]
        q = self.q_proj(x).reshape(tokens, self.num_heads, self.head_dim)  # [T, H, hd]
        k = self.k_proj(x).reshape(tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, hd]
        v = self.v_proj(x).reshape(tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, hd]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out, layer_kv = attention(q, k, v, pages, md, self.head_dim ** -0.5, self.sliding_window)  # [T, H, hd]
        return self.o_proj(out.reshape(tokens, -1)), layer_kv


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(d, f, bias=False, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, f, bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, d, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x, cos, sin, pages, md, attention):
        attn_out, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, pages, md, attention)
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x)).astype(x.dtype), new_kv


class LlamaForCausalLM(nnx.Module):
    """Per-layer weights in a Python list. The engine calls `embed`, each layer and `finish` as separate jitted
    steps (one compiled layer serves all of them); `__call__` chains them in one trace."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.config = cfg
        self.embed_tokens = normal_param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else normal_param(
            rngs, (cfg.hidden_size, cfg.vocab_size), dtype)

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
        """input_ids, positions [T] int32 -> (x [T, D], the RoPE tables cos, sin [T, hd]) for the layers."""
        table = self.embed_tokens[...]
        x = (table[input_ids] if embed is None else embed(table, input_ids)).astype(activation_dtype)  # [T, D]
        cfg = self.config  # static: the frequencies become trace-time constants, not state
        inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
        cos, sin = rotary_tables(positions, inv_freq)  # [T, hd] each
        return x, cos, sin

    def finish(self, x: jax.Array) -> jax.Array:
        """The last layer's output [T, D] -> the final hidden states (normalized, in the activation dtype)."""
        return self.norm(x).astype(x.dtype)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [S, D] -> logits [S, V] float32."""
        if self.lm_head is None:
            table = self.embed_tokens[...]
            return jnp.einsum("sd,vd->sv", hidden.astype(table.dtype), table, preferred_element_type=jnp.float32)
        head = self.lm_head[...]
        return jnp.einsum("sd,dv->sv", hidden.astype(head.dtype), head, preferred_element_type=jnp.float32)

    def hf_parameters(self, available: Container[str]) -> Iterator[HFParameter]:
        """Every parameter with its HF tensor name (torch layout: Linear weights are [out, in]) and the
        logical axes that tensor parallelism shards (see jvllm.parallel.mesh.LOGICAL_AXIS_RULES)."""
        yield self.embed_tokens, "model.embed_tokens.weight", False, ("vocab", "embed")
        yield self.norm.weight, "model.norm.weight", False, ("embed",)
        if self.lm_head is not None:
            name = "lm_head.weight" if "lm_head.weight" in available else "model.embed_tokens.weight"
            yield self.lm_head, name, True, ("embed", "vocab")
        out_axis = {"q_proj": "heads", "k_proj": "kv_heads", "v_proj": "kv_heads", "gate_proj": "mlp",
                    "up_proj": "mlp"}
        in_axis = {"o_proj": "heads", "down_proj": "mlp"}
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            yield layer.input_layernorm.weight, prefix + "input_layernorm.weight", False, ("embed",)
            yield layer.post_attention_layernorm.weight, prefix + "post_attention_layernorm.weight", False, ("embed",)
            for owner, group in ((layer.self_attn, "self_attn."), (layer.mlp, "mlp.")):
                for proj_name in (*out_axis, *in_axis):
                    proj: Linear | None = getattr(owner, proj_name, None)
                    if proj is None:
                        continue
                    name = prefix + group + proj_name
                    if proj_name in out_axis:  # column parallel: kernel [in, out] split by output
                        yield proj.kernel, name + ".weight", True, ("embed", out_axis[proj_name])
                        if proj.bias is not None:
                            yield proj.bias, name + ".bias", False, (out_axis[proj_name],)
                    else:  # row parallel: split by input; the partial sums are all-reduced
                        yield proj.kernel, name + ".weight", True, (in_axis[proj_name], "embed")
                        if proj.bias is not None:
                            yield proj.bias, name + ".bias", False, ("embed",)

    def load_hf_weights(self, tensors: Mapping[str, np.ndarray], dtype: jnp.dtype) -> None:
        """Fill every parameter from HF-named tensors (whole, on the default device)."""
        for param, name, transpose, _ in self.hf_parameters(tensors):
            if name not in tensors:
                raise ValueError(f"weights are missing tensor {name!r}")
            array = np.asarray(tensors[name])
            param.set_value(jnp.asarray(array.T if transpose else array, dtype=dtype))
