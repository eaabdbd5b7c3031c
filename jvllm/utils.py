"""Integer helpers shared by the host code: ceiling division and powers of two."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << max(n - 1, 0).bit_length()


def prev_power_of_2(n: int) -> int:
    """The largest power of two <= max(n, 1)."""
    return 1 << (max(n, 1).bit_length() - 1)
