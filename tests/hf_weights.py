"""Test helper: redraw a tiny transformers model's weights large enough that a wrong shard, head order or bias
moves the logits far above the tests' tolerances."""
from __future__ import annotations


def redraw_weights(model, seed: int = 1) -> None:
    """Every parameter in place: std 0.2 noise, norms 1 +- 0.2 (biases +- 0.2 like any other weight)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = 0.2 * torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + noise if "norm" in name else noise)
