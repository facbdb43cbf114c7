"""Integer helpers vLLM's files import from `vllm.utils.math_utils`."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division: `ceil(a / b)` for positive b."""
    return -(a // -b)


def round_up(x: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= x."""
    return cdiv(x, multiple) * multiple


def round_down(x: int, multiple: int) -> int:
    return (x // multiple) * multiple


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
