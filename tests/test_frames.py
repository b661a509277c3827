"""The one frame splitter (common/wire/frames.py): byte budget, item cap, order, too-large."""

import pytest

from ccsq.common.wire.frames import split_frames


def test_budget_and_cap_split_in_order() -> None:
    frames = split_frames(list(range(10)), size_of=lambda i: 30, budget_bytes=100, max_items=2)
    assert frames == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    frames = split_frames(list(range(7)), size_of=lambda i: 30, budget_bytes=100, max_items=10)
    assert frames == [[0, 1, 2], [3, 4, 5], [6]]
    assert split_frames([], size_of=len, budget_bytes=10, max_items=3) == []
    assert split_frames("abcde", max_items=2) == [["a", "b"], ["c", "d"], ["e"]]


def test_an_oversized_record_travels_alone_or_is_refused() -> None:
    assert split_frames([1, 500, 2], size_of=lambda i: i, budget_bytes=100, max_items=9) == [[1], [500], [2]]

    def refuse(item: int, n: int) -> Exception:
        return OverflowError(f"{item} is {n} bytes")

    with pytest.raises(OverflowError, match="500 is 500 bytes"):
        split_frames([1, 500], size_of=lambda i: i, budget_bytes=100, max_items=9, too_large=refuse)
    with pytest.raises(ValueError):
        split_frames([1], max_items=0)
