"""mula.units.format_count: a count with the unit of its size, at every size."""

import pytest

from mula.units import format_count


@pytest.mark.parametrize(
    "count, printed",
    [(0, "0"), (950, "950"), (999, "999"), (1_000, "1K"), (4_500, "4.5K"), (99_949, "99.9K"), (999_499, "999K"),
     (999_500, "1M"), (4_466_816, "4.47M"), (123_456_789, "123M"), (6_920_000_000, "6.92B"),
     (671_000_000_000, "671B"), (1_100_000_000_000, "1.1T")],
)  # fmt: skip
def test_format_count(count: int, printed: str) -> None:
    assert format_count(count) == printed
