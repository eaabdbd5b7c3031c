"""Integer helpers shared by the host code: ceiling division, powers of two, the positive-integer check."""
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


def check_positive(name: str, value: int | None, *, optional: bool = True) -> None:
    """Raise ValueError unless `value` is an integer >= 1 (or None, when `optional`)."""
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
