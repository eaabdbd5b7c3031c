"""Multimodal inputs: images in prompts and chat messages, their loading and preprocessing."""
