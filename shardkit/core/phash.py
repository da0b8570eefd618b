"""Perceptual hashes and the search for near ones: pure numpy, no decoding (callers hand in a
small grey thumbnail).

The hash is the DCT hash (pHash, as imagehash's `phash` computes it): a 32x32 luminance thumbnail,
its 2-D DCT-II, the 8x8 lowest frequencies compared with their median, 64 bits. Re-encoding,
resizing, grey and brightness changes move few of its bits; a crop of a few per cent moves more.

`near_pairs` finds every pair within a Hamming distance without comparing all pairs: multi-index
hashing (Norouzi et al., 2012). The 64 bits are cut into m bands; two hashes within distance T
agree within floor(T / m) bits on at least one band (pigeonhole), so each hash is looked up, per
band, under every variant of its band within that many bits, in a dense table of the band's
buckets, and only those candidates are compared in full. m (3 to 8) is chosen for the least work
at this count and threshold.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt

THUMBNAIL = 32
_BITS = 64


def _dct_matrix(size: int) -> npt.NDArray[np.float64]:
    """The orthonormal DCT-II matrix (rows: frequencies)."""
    k = np.arange(size)[:, None]
    n = np.arange(size)[None, :]
    matrix = np.cos(np.pi * (2 * n + 1) * k / (2 * size)) * math.sqrt(2 / size)
    matrix[0] /= math.sqrt(2)
    return matrix


_DCT = _dct_matrix(THUMBNAIL)
_LOW = np.ascontiguousarray(_DCT[:8])  # the 8 lowest frequencies: all the hash keeps


def dct_hash(thumbnail: np.ndarray) -> int:
    """The 64-bit DCT hash of a THUMBNAIL x THUMBNAIL grey image (any numeric dtype)."""
    if thumbnail.shape != (THUMBNAIL, THUMBNAIL):
        raise ValueError(f"a {THUMBNAIL}x{THUMBNAIL} thumbnail, not {thumbnail.shape}")
    low = _LOW @ thumbnail.astype(np.float64) @ _LOW.T
    bits = (low > np.median(low)).ravel()
    return int(np.packbits(bits).view(">u8")[0])


_BYTE_BITS = np.array([bin(i).count("1") for i in range(256)], np.int64)


def distances(a: np.ndarray, b: np.ndarray) -> npt.NDArray[np.int64]:
    """Hamming distances between uint64 hashes, elementwise."""
    xor = np.bitwise_xor(a, b)
    counts: npt.NDArray[np.int64]  # numpy's stubs type a ufunc's result, and a sum over an axis, as Any
    if hasattr(np, "bitwise_count"):  # numpy 2
        counts = np.bitwise_count(xor).astype(np.int64)
    else:
        counts = _BYTE_BITS[np.ascontiguousarray(xor).view(np.uint8).reshape(-1, 8)].sum(axis=1)
    return counts


def _bands(count: int, threshold: int) -> list[tuple[int, int]]:
    """(shift, width) of each band. More bands mean fewer variants to look up (a smaller radius)
    but fuller buckets (more candidates to compare); the count with the least work is taken, a
    candidate costing about 4 lookups (measured with numpy here). Widths stay within 22 bits (a
    band's table has 2**width entries)."""

    def work(bands: int) -> float:
        width = _BITS // bands
        variants = sum(math.comb(width, bits) for bits in range(threshold // bands + 1))
        return count * bands * variants * (1 + 4 * count / (1 << width))

    bands = min(range(3, 9), key=work)
    edges = np.linspace(0, _BITS, bands + 1).round().astype(int)
    return [(int(edges[i]), int(edges[i + 1] - edges[i])) for i in range(bands)]


def _variants(width: int, radius: int) -> npt.NDArray[np.uint64]:
    """Every mask of `width` bits with at most `radius` bits set."""
    masks = [0]
    for bits in range(1, radius + 1):
        masks += [sum(1 << b for b in chosen) for chosen in itertools.combinations(range(width), bits)]
    return np.array(masks, np.uint64)


def near_pairs(hashes: np.ndarray, threshold: int, chunk: int = 1 << 22) -> npt.NDArray[np.int64]:
    """Every pair (i, j), i < j, of `hashes` (uint64) within Hamming distance `threshold`, as an
    (n, 2) int64 array (each pair once). Work arrays hold about `chunk` lookups at a time."""
    hashes = np.ascontiguousarray(hashes, np.uint64)
    count = len(hashes)
    if count < 2:
        return np.zeros((0, 2), np.int64)
    found = []
    bands = _bands(count, threshold)
    for shift, width in bands:
        values = ((hashes >> np.uint64(shift)) & np.uint64((1 << width) - 1)).astype(np.int64)
        # The band's buckets as a counting sort: members of value v are order[starts[v]:starts[v] + sizes[v]].
        # A dense table (2**width entries, width about log2(count)) looks up in O(1), where
        # searchsorted took log(count) per lookup: 10x on a million hashes.
        order = np.argsort(values, kind="stable")
        sizes = np.bincount(values, minlength=1 << width)
        starts = np.cumsum(sizes) - sizes
        masks = _variants(width, threshold // len(bands)).astype(np.int64)
        items_per_step = max(1, chunk // len(masks))
        for first in range(0, count, items_per_step):
            items = np.arange(first, min(count, first + items_per_step))
            targets = (values[items, None] ^ masks[None, :]).ravel()
            hits = sizes[targets]
            have = np.flatnonzero(hits)
            repeats = hits[have]
            left = np.repeat(items[have // len(masks)], repeats)
            offsets = np.arange(len(left)) - np.repeat(np.cumsum(repeats) - repeats, repeats)
            right = order[np.repeat(starts[targets[have]], repeats) + offsets]
            keep = (left < right) & (distances(hashes[left], hashes[right]) <= threshold)
            if keep.any():
                found.append(np.stack([left[keep], right[keep]], axis=1))
    if not found:
        return np.zeros((0, 2), np.int64)
    return np.unique(np.concatenate(found), axis=0)


def components(count: int, pairs: np.ndarray) -> npt.NDArray[np.int64]:
    """The group of each of `count` items joined through `pairs` (union-find): an int64 array
    holding, per item, the smallest item of its group."""
    parent = list(range(count))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in pairs.tolist():
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return np.array([root(i) for i in range(count)], np.int64)


def near_components(hashes: np.ndarray, threshold: int) -> np.ndarray:
    """The group of each hash, joined through every pair within `threshold` (transitively), as the
    index of one hash of its group. Equal hashes are joined without pairing them: k distinct images
    with one hash (all-black tiles hash to 0) would otherwise make k^2 / 2 pairs."""
    values, first_index, inverse = np.unique(np.asarray(hashes, np.uint64), return_index=True, return_inverse=True)
    group = components(len(values), near_pairs(values, threshold))
    return first_index[group][inverse.ravel()]
