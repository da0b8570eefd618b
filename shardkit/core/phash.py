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
at this count and threshold. Work arrays are bounded (about `chunk` candidates at a time), and
`near_components` never lists the pairs: a dense cluster (all hashes within a few bits, so every
bucket holds most of them) is grouped in memory linear in its size.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt

THUMBNAIL = 32
PHASH_HEX = re.compile(r"[0-9a-f]{16}")  # a DCT hash as records and index.parquet carry it
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
    candidate weighing as much as about 4 lookups. Widths stay within 22 bits (a band's table has
    2**width entries)."""

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


class _Band(NamedTuple):
    """One band's buckets as a counting sort: the members of value v are
    order[starts[v]:starts[v] + sizes[v]]. A dense table (2**width entries, width about
    log2(count)) looks up in O(1), where a search of sorted values costs O(log count) per lookup."""

    values: npt.NDArray[np.int64]  # each hash's value in this band
    order: npt.NDArray[np.int64]
    sizes: npt.NDArray[np.int64]
    starts: npt.NDArray[np.int64]
    masks: npt.NDArray[np.int64]  # the variants each value is looked up under
    width: int


def _band_tables(hashes: npt.NDArray[np.uint64], threshold: int) -> Iterator[_Band]:
    """Each band's table in turn (one held at a time: up to 2**22 entries each)."""
    bands = _bands(len(hashes), threshold)
    for shift, width in bands:
        values = ((hashes >> np.uint64(shift)) & np.uint64((1 << width) - 1)).astype(np.int64)
        order = np.argsort(values, kind="stable")
        sizes = np.bincount(values, minlength=1 << width)
        starts = np.cumsum(sizes) - sizes
        yield _Band(values, order, sizes, starts, _variants(width, threshold // len(bands)).astype(np.int64), width)


def _lookups(band: _Band, count: int, chunk: int) -> Iterator[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]:
    """(item, bucket) for every lookup that finds a bucket with members, about `chunk` lookups
    at a time."""
    masks = band.masks
    items_per_step = max(1, chunk // len(masks))
    for first in range(0, count, items_per_step):
        items = np.arange(first, min(count, first + items_per_step))
        targets = (band.values[items, None] ^ masks[None, :]).ravel()
        have = np.flatnonzero(band.sizes[targets])
        yield items[have // len(masks)], targets[have]


def _members(
    band: _Band,
    left: npt.NDArray[np.int64],
    targets: npt.NDArray[np.int64],
    chunk: int,
    skip: int = 0,
    cap: int | None = None,
) -> Iterator[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]]:
    """Each lookup (left[k], targets[k]) against the members of its bucket (past the first `skip`,
    up to the `cap`th), as (left, right) arrays of about `chunk` candidates at a time: a bucket
    holding most of the hashes (a dense cluster) is never expanded for all lookups at once."""
    hits = band.sizes[targets] if cap is None else np.minimum(band.sizes[targets], cap)
    hits = np.maximum(hits - skip, 0)
    ends = np.cumsum(hits)
    first = 0
    while first < len(hits):
        done = int(ends[first - 1]) if first else 0
        stop = max(first + 1, int(np.searchsorted(ends, done + chunk, side="right")))
        repeats = hits[first:stop]
        offsets = np.arange(int(repeats.sum())) - np.repeat(np.cumsum(repeats) - repeats - skip, repeats)
        right = band.order[np.repeat(band.starts[targets[first:stop]], repeats) + offsets]
        yield np.repeat(left[first:stop], repeats), right
        first = stop


def near_pairs(hashes: np.ndarray, threshold: int, chunk: int = 1 << 22) -> npt.NDArray[np.int64]:
    """Every pair (i, j), i < j, of `hashes` (uint64) within Hamming distance `threshold`, as an
    (n, 2) int64 array (each pair once). Work arrays hold about `chunk` lookups and candidates at
    a time; the answer itself is as large as it is (a dense cluster of k hashes has k^2 / 2
    pairs: `near_components` groups them without listing them)."""
    hashes = np.ascontiguousarray(hashes, np.uint64)
    count = len(hashes)
    if count < 2:
        return np.zeros((0, 2), np.int64)
    found = []
    for band in _band_tables(hashes, threshold):
        for items, targets in _lookups(band, count, chunk):
            for left, right in _members(band, items, targets, chunk):
                keep = (left < right) & (distances(hashes[left], hashes[right]) <= threshold)
                if keep.any():
                    found.append(np.stack([left[keep], right[keep]], axis=1))
    if not found:
        return np.zeros((0, 2), np.int64)
    return np.unique(np.concatenate(found), axis=0)


def near_any(
    hashes: np.ndarray, queries: np.ndarray, threshold: int, budget: int, chunk: int = 1 << 22
) -> npt.NDArray[np.bool_] | None:
    """Which of `hashes` are within `threshold` of at least one of `queries` (both uint64): an
    append's new files looked up in an output's records, in time about the queries' lookups, not
    the records' pairs. None where that would compare more than `budget` candidate pairs (a dense
    cluster: most hashes in a few buckets), for the caller to group the whole set instead."""
    hashes = np.ascontiguousarray(hashes, np.uint64)
    queries = np.ascontiguousarray(queries, np.uint64)
    found = np.zeros(len(hashes), bool)
    if not len(hashes) or not len(queries):
        return found
    spent = 0  # candidate pairs compared so far
    for (shift, width), band in zip(_bands(len(hashes), threshold), _band_tables(hashes, threshold), strict=True):
        asked = ((queries >> np.uint64(shift)) & np.uint64((1 << width) - 1)).astype(np.int64)
        masks = band.masks
        step = max(1, chunk // len(masks))
        for first in range(0, len(queries), step):
            items = np.arange(first, min(len(queries), first + step))
            targets = (asked[items, None] ^ masks[None, :]).ravel()
            have = np.flatnonzero(band.sizes[targets])
            spent += int(band.sizes[targets[have]].sum())
            if spent > budget:
                return None
            for left, right in _members(band, items[have // len(masks)], targets[have], chunk):
                found[right[distances(queries[left], hashes[right]) <= threshold]] = True
    return found


def components(count: int, pairs: np.ndarray) -> npt.NDArray[np.int64]:
    """The group of each of `count` items joined through `pairs` (union-find): an int64 array
    holding, per item, the smallest item of its group."""
    parent = np.arange(count, dtype=np.int64)
    pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
    _union(parent, pairs[:, 0], pairs[:, 1])
    return _flatten(parent)


def _flatten(parent: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Every item pointed at its root, in place (each link points to a smaller item: a root is
    the smallest of its group); returns `parent`."""
    while True:
        up = parent[parent]
        if np.array_equal(up, parent):
            return parent
        parent[:] = up


def _roots(parent: npt.NDArray[np.int64], items: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    found = parent[items]
    while True:
        up = parent[found]
        if np.array_equal(up, found):
            parent[items] = found  # the path shortened for the next look
            return found
        found = up


def _union(parent: npt.NDArray[np.int64], a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]) -> None:
    """Join the groups of a[k] and b[k] for every k, vectorized: each round links every larger
    root to the smallest root it is paired with, until all pairs share a root."""
    while len(a):
        ra, rb = _roots(parent, a), _roots(parent, b)
        apart = ra != rb
        low, high = np.minimum(ra[apart], rb[apart]), np.maximum(ra[apart], rb[apart])
        np.minimum.at(parent, high, low)
        a, b = low, high


_SEED_MEMBERS = 2  # the first members of each bucket, compared in a first pass
_DENSE_BUCKET = 64  # a bucket of more members than this makes the first pass worth its lookups


def _near_groups(values: npt.NDArray[np.uint64], threshold: int, chunk: int) -> npt.NDArray[np.int64]:
    """`components` of the pairs within `threshold`, without listing the pairs: they are joined
    as they are found, and a lookup whose bucket lies wholly in its own group is not expanded.
    The first band is first looked up against the first members of each bucket only, so that a
    dense cluster (burst shots, video frames: most hashes in a few buckets) is one group early and
    its buckets are then skipped whole; then every band against the rest of each bucket not
    skipped. Memory: the hashes, one band's table and about `chunk` candidates, whatever the pairs."""
    count = len(values)
    parent = np.arange(count, dtype=np.int64)
    if count < 2:
        return parent
    for number, band in enumerate(_band_tables(values, threshold)):
        # Seeding and skipping whole buckets pay off only where buckets are crowded (a dense
        # cluster); with scattered hashes (buckets of one or two) they would cost a second pass of
        # lookups and a regrouping per step for nothing: such a band is simply joined.
        crowded = int(band.sizes.max()) > _DENSE_BUCKET
        if not crowded:
            for items, targets in _lookups(band, count, chunk):
                _join_near(parent, values, threshold, _members(band, items, targets, chunk))
            continue
        if number == 0:
            for items, targets in _lookups(band, count, chunk):
                _join_near(parent, values, threshold, _members(band, items, targets, chunk, 0, _SEED_MEMBERS))
        skip = _SEED_MEMBERS if number == 0 else 0  # the members the first pass compared
        groups = _BucketGroups(band)
        for items, targets in _lookups(band, count, chunk):
            roots = groups.roots(parent)  # a lookup into a bucket all of its own group is done
            wanted = (band.sizes[targets] > skip) & (groups.of(targets) != roots[items])
            joined = _join_near(parent, values, threshold, _members(band, items[wanted], targets[wanted], chunk, skip))
            groups.stale |= joined
    return _flatten(parent)


def _join_near(
    parent: npt.NDArray[np.int64], values: npt.NDArray[np.uint64], threshold: int,
    candidates: Iterator[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]],
) -> bool:  # fmt: skip
    """Join every candidate pair within `threshold`; whether any was."""
    joined = False
    for left, right in candidates:
        near = (distances(values[left], values[right]) <= threshold) & (left != right)
        if near.any():
            _union(parent, left[near], right[near])
            joined = True
    return joined


class _BucketGroups:
    """Per bucket of a band, the group all its members are in (-1: several), computed again only
    after a join: O(count) each time, never O(2**width)."""

    def __init__(self, band: _Band) -> None:
        self.band = band
        self.used = np.flatnonzero(band.sizes)
        self.slot = np.full(len(band.sizes), -1, np.int64)
        self.slot[self.used] = np.arange(len(self.used))
        self.stale = True
        self._roots = np.zeros(0, np.int64)
        self._groups = np.zeros(0, np.int64)

    def roots(self, parent: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        if self.stale:
            self._roots = _flatten(parent).copy()
            member_roots = self._roots[self.band.order]
            low = np.minimum.reduceat(member_roots, self.band.starts[self.used])
            high = np.maximum.reduceat(member_roots, self.band.starts[self.used])
            self._groups = np.where(low == high, low, -1)
            self.stale = False
        return self._roots

    def of(self, targets: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The group of each target bucket (each one with members)."""
        found: npt.NDArray[np.int64] = self._groups[self.slot[targets]]
        return found


def near_components(hashes: np.ndarray, threshold: int, chunk: int = 1 << 20) -> npt.NDArray[np.int64]:
    """The group of each hash, joined through every pair within `threshold` (transitively), as the
    index of one hash of its group (the first of the smallest value). Equal hashes are joined
    without pairing them: k distinct images with one hash (all-black tiles hash to 0) would
    otherwise make k^2 / 2 pairs; near ones are joined without listing their pairs (`_near_groups`),
    so k near-identical frames take memory in k, not k^2."""
    values, first_index, inverse = np.unique(np.asarray(hashes, np.uint64), return_index=True, return_inverse=True)
    group = _near_groups(values, threshold, chunk)
    result: npt.NDArray[np.int64] = first_index[group][inverse.ravel()]
    return result
