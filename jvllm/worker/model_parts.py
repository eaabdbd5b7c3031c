"""A loaded model split for per-layer steps: the outer part (embedding, final norm, LM head) and its layers.

One jitted layer function serves every layer of a structure, so a step shape compiles one layer per distinct
layer structure (one for most models; dense and mixture-of-experts layers of a model are two) instead of the
whole unrolled model: a fraction of the compile time, and the same speed per step."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class PartWeights:
    """Flat weight lists: the outer part's, and each layer's (the layers of a group flatten in the same order)."""

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
    layer_graphdefs: tuple[Any, ...]  # one per layer group: layers of one structure
    layer_treedefs: tuple[Any, ...]
    layer_groups: tuple[int, ...]  # per layer: its group

    @property
    def num_layers(self) -> int:
        return len(self.layer_groups)

    @property
    def group_first_layers(self) -> list[int]:
        """Per group, the index of its first layer (whose weights stand for the group when compiling)."""
        return [self.layer_groups.index(g) for g in range(len(self.layer_graphdefs))]

    def outer(self, leaves: list[jax.Array]) -> Any:
        return nnx.merge(self.outer_graphdef, self.layers_shapes, jax.tree.unflatten(self.outer_treedef, leaves))

    def layer(self, leaves: list[jax.Array], group: int = 0) -> Any:
        return nnx.merge(self.layer_graphdefs[group], jax.tree.unflatten(self.layer_treedefs[group], leaves))


def split_model(graphdef: Any, state: Any) -> tuple[ModelParts, PartWeights, Any, list[Any]]:
    """-> (structure, weights, the outer part's state and each layer's state (for per-leaf layout choices))."""
    model = nnx.merge(graphdef, state)
    outer_graphdef, layers_state, outer_state = nnx.split(model, nnx.PathContains("layers"), ...)
    layer_states, graphdefs, treedefs, groups = [], [], [], []
    for layer in model.layers:
        graphdef_i, state_i = nnx.split(layer)
        if graphdef_i not in graphdefs:
            graphdefs.append(graphdef_i)
            treedefs.append(jax.tree.flatten(state_i)[1])
        groups.append(graphdefs.index(graphdef_i))
        layer_states.append(state_i)
    outer_leaves, outer_treedef = jax.tree.flatten(outer_state)
    layer_leaves = [jax.tree.flatten(s)[0] for s in layer_states]
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layers_state)
    parts = ModelParts(outer_graphdef, outer_treedef, shapes, tuple(graphdefs), tuple(treedefs), tuple(groups))
    return parts, PartWeights(outer_leaves, layer_leaves), outer_state, layer_states
