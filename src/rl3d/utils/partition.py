"""Token-balanced partitions of samples: over data-parallel ranks and over micro-batches.

    parts = balanced_partition([12, 3, 40, 7], num_parts=2)   # [[1, 2], [0, 3]]: 43 and 19 tokens
    imbalance([12, 3, 40, 7], parts)                           # 43 / 31 = 1.39 (contiguous: 1.52)

Sorted greedy (longest processing time first): samples in order of decreasing length, each to
the least-loaded part that still has room. With `equal_size` every part gets the same number of
samples (data-parallel ranks must run the same number of optimizer steps); without it a part
takes any number, under an optional token `budget`. The result is deterministic (ties go to the
lower index), so every controller computes the same partition from the same lengths, and
indices within a part ascend.
"""

from __future__ import annotations


def balanced_partition(
    lengths: list[int], num_parts: int, *, equal_size: bool = True, budget: int | None = None
) -> list[list[int]] | None:
    """Sample indices per part, loads balanced; None when some sample fits no part under `budget`."""
    n = len(lengths)
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if equal_size and n % num_parts:
        raise ValueError(f"{n} samples do not split into {num_parts} parts of equal size")
    cap = n // num_parts if equal_size else n
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    loads = [0] * num_parts
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        room = [
            p
            for p in range(num_parts)
            if len(parts[p]) < cap and (budget is None or loads[p] + lengths[i] <= budget)
        ]
        if not room:
            return None
        p = min(room, key=lambda p: (loads[p], p))
        parts[p].append(i)
        loads[p] += lengths[i]
    return [sorted(part) for part in parts]


def chunked_partition(lengths: list[int], num_parts: int, chunk: int) -> list[list[int]]:
    """Balance every `chunk` consecutive samples (a global mini-batch) over `num_parts` ranks,
    equal counts per rank; a rank's share is its part of chunk 0, then of chunk 1, ... so that
    its k-th `chunk // num_parts` samples are its part of mini-batch k, whatever the rank count."""
    n = len(lengths)
    if chunk <= 0 or n % chunk or chunk % num_parts:
        raise ValueError(
            f"{n} samples in mini-batches of {chunk} do not split evenly over {num_parts} data-parallel ranks"
        )
    shares: list[list[int]] = [[] for _ in range(num_parts)]
    for start in range(0, n, chunk):
        parts = balanced_partition(lengths[start : start + chunk], num_parts)
        assert parts is not None  # no budget: always fits
        for share, part in zip(shares, parts):
            share.extend(start + i for i in part)
    return shares


def imbalance(lengths: list[int], parts: list[list[int]]) -> float:
    """Largest part's tokens over the mean part's (1.0 = perfectly balanced)."""
    loads = [sum(lengths[i] for i in part) for part in parts]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0
