"""8-byte hashes of keys and source paths, not the strings: verify compares millions of them in
bounded memory, and reads the strings again only to name what turns out to be wrong."""

from __future__ import annotations

import numpy as np


def hashes(strings: list[str]) -> np.ndarray:
    return np.fromiter(map(hash, strings), np.int64, len(strings))


def joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def repeated(hashed: np.ndarray) -> np.ndarray:
    values, counts = np.unique(hashed, return_counts=True)
    return values[counts > 1]
