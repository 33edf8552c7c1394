"""Deterministic row samples: a row's hash decides whether it is drawn, so a sample never depends on
the order or the company its rows arrive in.
"""

from __future__ import annotations

import numpy as np


def row_hashes(x: np.ndarray, seed: int) -> np.ndarray:
    """A seeded 64-bit hash of each row's values: the same whatever order or batch a row comes in."""
    words = np.ascontiguousarray(x, dtype=np.float64).view(np.uint64)
    multipliers = np.random.default_rng([seed & 0xFFFFFFFF, 0x5A3D]).integers(
        1, np.iinfo(np.int64).max, size=x.shape[1], dtype=np.uint64
    ) | np.uint64(1)
    mixed = (words * multipliers).sum(axis=1, dtype=np.uint64)  # wraps modulo 2^64
    mixed ^= mixed >> np.uint64(33)  # the finalizer of MurmurHash3, so every bit depends on every word
    mixed *= np.uint64(0xFF51AFD7ED558CCD)
    mixed ^= mixed >> np.uint64(33)
    return mixed


def smallest_hashes(x: np.ndarray, hashes: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The size rows of x with the smallest hashes (all rows if there are fewer), and their hashes."""
    if len(x) <= size:
        return x, hashes
    keep = np.argpartition(hashes, size - 1)[:size]
    return x[keep], hashes[keep]


def scale_counts(counts: np.ndarray, total: int) -> np.ndarray:
    """Integer counts proportional to counts that add up to total (largest remainders get the rest).

    A device clustered on a sample of its rows reports counts for all of its rows this way.
    """
    counts = np.asarray(counts, dtype=np.float64)
    exact = counts * (total / counts.sum())
    scaled = np.floor(exact).astype(np.int64)
    remainder = int(total - scaled.sum())
    if remainder:
        scaled[np.argsort(-(exact - scaled), kind="stable")[:remainder]] += 1
    return scaled
