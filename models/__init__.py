"""Flax model families, weight loading and the architecture registry."""
