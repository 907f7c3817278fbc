"""Numbers as people read them: a count with the unit of its size (K, M, B, T)."""

from __future__ import annotations

_UNITS = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"))


def format_count(n: float) -> str:
    """`n` to three significant digits in the largest unit it reaches: 950, 4.5K, 7.07M, 123M, 1.1T."""
    for scale, unit in _UNITS:
        if abs(n) >= scale * 0.9995:  # 999,999 prints as 1.00M, not 1000K
            return f"{n / scale:.3g}{unit}" if abs(n) < scale * 99.95 else f"{n / scale:.0f}{unit}"
    return f"{n:.0f}"
