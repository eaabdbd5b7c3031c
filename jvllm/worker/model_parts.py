"""A loaded model split for per-layer steps: the outer part (embedding, final norm, LM head) and its layers.

One jitted layer function serves every layer (they share a structure), so a step shape compiles one layer
instead of the whole unrolled model: a fraction of the compile time, and the same speed per step."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class PartWeights:
    """Flat weight lists: the outer part's, and each layer's (all layers flatten in the same order)."""

    outer: list[jax.Array]
    layers: list[list[jax.Array]]

    @property
    def leaves(self) -> list[jax.Array]:
        """Every weight array, outer part first."""
        return [*self.outer, *(leaf for layer in self.layers for leaf in layer)]


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """Static structure: how to rebuild the outer module and a layer from their flat weights inside a jit."""

    outer_graphdef: Any
    outer_treedef: Any
    layers_shapes: Any  # the layers' state as shapes only: the outer module never computes with them
    layer_graphdef: Any
    layer_treedef: Any
    num_layers: int

    def outer(self, leaves: list[jax.Array]) -> Any:
        return nnx.merge(self.outer_graphdef, self.layers_shapes, jax.tree.unflatten(self.outer_treedef, leaves))

    def layer(self, leaves: list[jax.Array]) -> Any:
        return nnx.merge(self.layer_graphdef, jax.tree.unflatten(self.layer_treedef, leaves))


def split_model(graphdef: Any, state: Any) -> tuple[ModelParts, PartWeights, Any, list[Any]]:
    """-> (structure, weights, the outer part's state and each layer's state (for per-leaf layout choices))."""
    model = nnx.merge(graphdef, state)
    outer_graphdef, layers_state, outer_state = nnx.split(model, nnx.PathContains("layers"), ...)
    layer_states = []
    layer_graphdef = None
    for layer in model.layers:
        graphdef_i, state_i = nnx.split(layer)
        if layer_graphdef is None:
            layer_graphdef = graphdef_i
        elif graphdef_i != layer_graphdef:
            raise ValueError("the model's layers differ in structure; one compiled layer cannot serve them all")
        layer_states.append(state_i)
    outer_leaves, outer_treedef = jax.tree.flatten(outer_state)
    layer_leaves = [jax.tree.flatten(s)[0] for s in layer_states]
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layers_state)
    parts = ModelParts(outer_graphdef, outer_treedef, shapes, layer_graphdef,
                       jax.tree.flatten(layer_states[0])[1], len(layer_states))
    return parts, PartWeights(outer_leaves, layer_leaves), outer_state, layer_states
