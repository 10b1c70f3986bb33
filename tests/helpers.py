"""Comparison helpers shared by the tests."""

from __future__ import annotations

from collections.abc import Callable

import torch

NEAR_TIE = 1e-3


def top2_gap(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_greedy_match(
    expected: list[int],
    got: list[int],
    logits_at: Callable[[int], torch.Tensor],
    label: str = "",
) -> str:
    """Greedy tokens must match; a divergence is accepted only at a near-tie of the reference.

    ``logits_at(i)`` returns the reference's logits for output position ``i``. Returns a short
    report line (the tests print it so a run shows where ties happened).
    """
    i = first_divergence(expected, got)
    if i is None:
        return f"{label}: all {len(expected)} tokens equal"
    if i >= min(len(expected), len(got)):
        raise AssertionError(f"{label}: lengths differ ({len(expected)} vs {len(got)}) with equal prefix")
    gap = top2_gap(logits_at(i))
    assert gap < NEAR_TIE, (
        f"{label}: diverged at output token {i} ({expected[i]} vs {got[i]}) where the reference's "
        f"top-2 logit gap is {gap:.2e} (not a near-tie)\nexpected {expected}\ngot      {got}"
    )
    return f"{label}: diverged at token {i} at a near-tie (gap {gap:.2e})"
