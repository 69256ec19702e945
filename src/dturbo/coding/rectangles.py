"""The rectangle search of cluster coding (:mod:`dturbo.codec`, "Cluster coding"): disjoint rectangles that
cover a support where sending their zeros costs less than the positions they save; vectorised over boxes and cuts."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy import ndimage
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from .bits import _bits_for, _varint
from .positions import _position_plan


# ======================================================================== grid
def _sat(a: np.ndarray) -> np.ndarray:
    """Summed-area table with a zero first row and column."""
    s = np.zeros((a.shape[0] + 1, a.shape[1] + 1), dtype=np.int64)
    np.cumsum(np.cumsum(a, axis=0, dtype=np.int64), axis=1, out=s[1:, 1:])
    return s


def _box_sum(sat: np.ndarray, r0: Any, c0: Any, r1: Any, c1: Any) -> Any:
    """Sum over rows r0..r1-1, cols c0..c1-1 from a summed-area table (vectorised over array arguments)."""
    return sat[r1, c1] - sat[r0, c1] - sat[r1, c0] + sat[r0, c0]


class _Costs:
    """The cost model of the rectangle search (bits): ``F`` per rectangle record, ``b`` per value, ``p`` per
    scattered position (an estimate), rectangles at least ``mc`` x ``mc``."""

    def __init__(self, F: int, b: int, p: float, mc: int) -> None:
        self.F, self.b, self.p, self.mc = F, b, p, mc

    def estimate(self, nnz: np.ndarray, h: np.ndarray, w: np.ndarray) -> np.ndarray:
        """Cheaper of one rectangle (if at least mc x mc) and scattered points, for boxes holding nnz nonzeros."""
        rect = np.where((h >= self.mc) & (w >= self.mc), self.F + self.b * h * w, np.inf)
        return np.minimum(rect, nnz * (self.b + self.p))


def _segmented_accumulate(values: np.ndarray, seg: np.ndarray, op: np.ufunc, reverse: bool) -> np.ndarray:
    """Running ``op`` (np.minimum or np.maximum) of ``values``, restarted in every segment; ``seg`` holds the
    segment ids, contiguous and increasing. One vectorised pass: each segment is shifted by a multiple of the
    value range so that no other segment can win the comparison."""
    if not values.size:
        return values
    span = int(values.max()) - int(values.min()) + 1
    rank = (int(seg[-1]) - seg) if reverse else seg
    shift = rank * span * (1 if op is np.maximum else -1)
    shifted = values + shift
    acc = op.accumulate(shifted[::-1])[::-1] if reverse else op.accumulate(shifted)
    return acc - shift


def _cuts_along(
    a0: np.ndarray, a1: np.ndarray, b0: np.ndarray, b1: np.ndarray, nxt: np.ndarray, prv: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every guillotine cut across the lines (rows, or columns when the tables are transposed) of every box
    [a0, a1) x [b0, b1), all boxes at once. ``nxt[g, b]`` is the first core cell at or after cross index b on
    line g (or the line length), ``prv[g, b]`` one past the last core cell before b (or 0). Returns the box id of
    every cut and its two halves (low: lines before the cut, high: the others), each shrunk to the bounding box
    of its core cells, as (n, 4) arrays of (a0, a1, b0, b1)."""
    n = a1 - a0
    seg = np.repeat(np.arange(n.size), n)
    starts = np.cumsum(n) - n
    pos = np.arange(seg.size) - starts[seg]
    g = a0[seg] + pos
    first = nxt[g, b0[seg]]
    nonempty = first < b1[seg]
    big = nxt.shape[0] + nxt.shape[1] + 2
    first = np.where(nonempty, first, big)
    last = np.where(nonempty, prv[g, b1[seg]], -1)
    acc = _segmented_accumulate
    lo_end = acc(np.where(nonempty, g + 1, -1), seg, np.maximum, False)
    lo_b0, lo_b1 = acc(first, seg, np.minimum, False), acc(last, seg, np.maximum, False)
    hi_beg = acc(np.where(nonempty, g, big), seg, np.minimum, True)
    hi_b0, hi_b1 = acc(first, seg, np.minimum, True), acc(last, seg, np.maximum, True)
    lo_sel = pos < (n - 1)[seg]  # the cut after line pos: low half = lines <= pos
    hi_sel = pos > 0  # the same cuts, seen from the high half's first line
    box = seg[lo_sel]
    low = np.stack([a0[box], lo_end[lo_sel], lo_b0[lo_sel], lo_b1[lo_sel]], axis=1)
    high = np.stack([hi_beg[hi_sel], a1[box], hi_b0[hi_sel], hi_b1[hi_sel]], axis=1)
    return box, low, high


def _line_tables(core: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nxt, prv) of :func:`_cuts_along` for the rows of ``core`` (K, M+1 each)."""
    k, m = core.shape
    ar = np.arange(m)
    nxt = np.full((k, m + 1), m, np.int64)
    nxt[:, :m] = np.minimum.accumulate(np.where(core, ar, m)[:, ::-1], axis=1)[:, ::-1]
    prv = np.zeros((k, m + 1), np.int64)
    prv[:, 1:] = np.maximum.accumulate(np.where(core, ar + 1, 0), axis=1)
    return nxt, prv


def _disjoint_boxes(core: np.ndarray) -> np.ndarray:
    """Disjoint boxes (n, 4) = (r0, r1, c0, c1) holding the core: the bounding boxes of its 4-connected pieces,
    boxes that overlap merged into their common bounding box, repeatedly, until none overlap (boxes that merely
    touch stay apart). A box then holds only the core cells of its own pieces, so the boxes can be split
    independently and their rectangles never overlap. Overlapping pairs come from a vectorised sweep over the
    boxes sorted by first row; the groups to merge are the connected components of the overlap graph."""
    labels, count = ndimage.label(core)
    if not count:
        return np.zeros((0, 4), np.int64)
    b = np.array([(r.start, r.stop, c.start, c.stop) for r, c in ndimage.find_objects(labels)], np.int64)
    while len(b) > 1:
        n = len(b)
        b = b[np.argsort(b[:, 0], kind="stable")]
        # candidates j > i start before box i ends (rows overlap); then keep those whose columns overlap too
        reach = np.maximum(np.searchsorted(b[:, 0], b[:, 1], side="left") - np.arange(n) - 1, 0)
        i = np.repeat(np.arange(n), reach)
        j = i + 1 + np.arange(i.size) - np.repeat(np.cumsum(reach) - reach, reach)
        both = (b[i, 2] < b[j, 3]) & (b[j, 2] < b[i, 3])
        if not both.any():
            break
        graph = csr_matrix((np.ones(int(both.sum())), (i[both], j[both])), shape=(n, n))
        count, comp = connected_components(graph, directed=False)
        merged = np.empty((count, 4), np.int64)
        merged[:, [0, 2]] = np.iinfo(np.int64).max
        merged[:, [1, 3]] = -1
        for col, op in enumerate((np.minimum, np.maximum, np.minimum, np.maximum)):
            op.at(merged[:, col], comp, b[:, col])
        b = merged
    return b


class _Search:
    """One rectangle search over a K x M support (docs/algorithm.md §9 cluster coding), fully vectorised.

    ``core``: the union of the all-nonzero ``mc x mc`` windows (the support's morphological opening), the shapes
    rectangles are cut from; nonzeros outside it (ragged edges, isolated points) stay scattered unless a rectangle
    cut from the core contains them. The search is a guillotine splitting of the disjoint boxes that hold the
    core's pieces (:func:`_disjoint_boxes`), run generation by generation: all boxes of a generation are priced
    and cut in one set of numpy operations (every row and column cut of every box, see :func:`_cuts_along`), so
    the Python loop runs over generations (the depth of the splitting), never over weights or even boxes.
    Rectangles come out disjoint by construction."""

    def __init__(self, support: np.ndarray, costs: _Costs) -> None:
        k, m = support.shape
        mc = costs.mc
        self.costs = costs
        self.sat_nz = _sat(support)
        win = _box_sum(self.sat_nz, slice(0, k - mc + 1), slice(0, m - mc + 1), slice(mc, k + 1), slice(mc, m + 1))
        full = win == mc * mc  # origins of the all-nonzero windows
        self.sat_full = _sat(full)
        pad = np.zeros((k + mc - 1, m + mc - 1), np.int64)  # full origins shifted by mc-1: core = window sums > 0
        pad[mc - 1 : k, mc - 1 : m] = full
        sp = _sat(pad)
        self.core = _box_sum(sp, slice(0, k), slice(0, m), slice(mc, k + mc), slice(mc, m + mc)) > 0
        self.rows = _line_tables(self.core)
        self.cols = _line_tables(self.core.T)
        self.roots = _disjoint_boxes(self.core)

    def _price(self, boxes: np.ndarray) -> np.ndarray:
        """Estimated bits of (n, 4) boxes (r0, r1, c0, c1)."""
        r0, r1, c0, c1 = boxes.T
        return self.costs.estimate(_box_sum(self.sat_nz, r0, c0, r1, c1), r1 - r0, c1 - c0)

    def run(self, n_min: int, full_only: bool = False) -> np.ndarray:
        """Rectangles (R, 4) = (row, col, h, w). Every box of a generation is (1) dropped when it is smaller than
        mc x mc, holds no all-nonzero window or fewer than ``n_min`` nonzeros; (2) sent whole when it is full;
        otherwise its best cut (least estimated bits of the two shrunk halves; ties: the more balanced cut) is (3)
        taken when it beats both one rectangle and scattered points; (4) else the box is one rectangle when that beats
        scattered points; (5) else it is cut anyway (it still holds an all-nonzero window). Cuts shrink boxes, so
        the loop ends."""
        c, mc = self.costs, self.costs.mc
        boxes = self.roots
        out = [np.zeros((0, 4), np.int64)]
        while boxes.size:
            r0, r1, c0, c1 = boxes.T
            h, w = r1 - r0, c1 - c0
            nnz = _box_sum(self.sat_nz, r0, c0, r1, c1)
            ok = (h >= mc) & (w >= mc) & (nnz >= n_min)
            ok[ok] = _box_sum(self.sat_full, r0[ok], c0[ok], r1[ok] - mc + 1, c1[ok] - mc + 1) > 0
            full = ok & (nnz == h * w)
            out.append(boxes[full])
            live = ok & ~full
            boxes, h, w, nnz = boxes[live], h[live], w[live], nnz[live]
            if not boxes.size:
                break
            r0, r1, c0, c1 = boxes.T
            rb, rlow, rhigh = _cuts_along(r0, r1, c0, c1, *self.rows)
            cb, clow, chigh = _cuts_along(c0, c1, r0, r1, *self.cols)
            box = np.concatenate([rb, cb])
            low = np.concatenate([rlow, clow[:, [2, 3, 0, 1]]])
            high = np.concatenate([rhigh, chigh[:, [2, 3, 0, 1]]])
            est = self._price(low) + self._price(high)
            area_lo = (low[:, 1] - low[:, 0]) * (low[:, 3] - low[:, 2])
            bigger = np.maximum(area_lo, (high[:, 1] - high[:, 0]) * (high[:, 3] - high[:, 2]))
            order = np.lexsort((bigger, est, box))  # ties: the more balanced cut (shallower splitting)
            ids, at = np.unique(box[order], return_index=True)
            best = order[at]
            best_est = np.full(boxes.shape[0], np.inf)
            best_est[ids] = est[best]
            cut_of = np.full(boxes.shape[0], -1)
            cut_of[ids] = best
            rect = c.F + c.b * h * w
            scat = nnz * (c.b + c.p)
            # A rectangle with zeros inside is fine when its values travel with it (the zeros say where S is not);
            # a support coded alone (``full_only``) can only hold whole rectangles.
            accept = (best_est >= np.minimum(rect, scat)) & (rect < scat) & (not full_only)
            out.append(boxes[accept])
            cut = cut_of[~accept & (cut_of >= 0)]
            boxes = np.concatenate([low[cut], high[cut]])
        found = np.concatenate(out)
        return np.stack([found[:, 0], found[:, 2], found[:, 1] - found[:, 0], found[:, 3] - found[:, 2]], axis=1)


def _merge_touching(rects: np.ndarray) -> np.ndarray:
    """Merge rectangles (row, col, h, w) that share a whole side (same rows and adjacent columns, or the other
    way round) into one: the same cells for one record less. Vectorised over chains; repeats until stable."""
    changed = True
    while changed and len(rects) > 1:
        changed = False
        for swap in ([0, 1, 2, 3], [1, 0, 3, 2]):  # merge along columns, then along rows (transposed view)
            r = rects[:, swap]
            r = r[np.lexsort((r[:, 1], r[:, 2], r[:, 0]))]  # by row, height, then column
            start = np.ones(len(r), bool)
            start[1:] = (r[1:, 0] != r[:-1, 0]) | (r[1:, 2] != r[:-1, 2]) | (r[1:, 1] != r[:-1, 1] + r[:-1, 3])
            if start.all():
                continue
            merged = r[start]
            merged[:, 3] = np.bincount(np.cumsum(start) - 1, weights=r[:, 3]).astype(np.int64)
            rects = merged[:, swap]
            changed = True
    return rects


def _position_bits(count: int, n: int) -> float:
    """Rough bits per position of ``count`` scattered points among n with the cheapest scheme: Rice
    ~ log2(n / count) + 1.5, capped by the bitmap (n / count) and the index list (ceil(log2 n)). An estimate for
    the search's cost model only; plans are compared by their exact bits."""
    c = max(count, 1)
    return float(min(max(_bits_for(n), 1), n / c, math.log2(max(n / c, 1.0)) + 1.5))


def _plan(support: np.ndarray, rects: np.ndarray, F: int, value_bits: int) -> tuple[int, np.ndarray]:
    """Exact bits of the cluster coding of ``support`` with these (R, 4) rectangles (all but the constant flags,
    K and M header bytes), and the scattered flat indices it leaves."""
    covered = np.zeros(support.shape, bool)
    for r0, c0, h, w in rects.tolist():  # a loop over rectangles
        covered[r0 : r0 + h, c0 : c0 + w] = True
    scattered = np.flatnonzero(support & ~covered)
    pos_bits = _position_plan(scattered, support.size)[1]
    area = int((rects[:, 2] * rects[:, 3]).sum())
    bits = 8 * ((F * len(rects) + pos_bits + 7) // 8) + value_bits * (area + scattered.size)
    return bits + 8 * (len(_varint(len(rects))) + len(_varint(scattered.size))), scattered


def _find_rectangles(support: np.ndarray, min_cluster: int, value_bits: int, full_only: bool = False) -> np.ndarray:
    """Disjoint rectangles (R, 4) = (row, col, height, width) of the cluster coding (§9); see the module
    docstring for the rule and :class:`_Search` for the method.

    The position cost ``p`` of a scattered point is first estimated from the nonzeros outside the core; when the
    scattered points actually left over imply a clearly different ``p``, the search runs once more with it. The
    cheapest of these plans and of "no rectangle at all" (exact bit counts) wins, so a grid never costs more
    than its nonzeros sent as scattered points (up to a byte of header)."""
    k, m = support.shape
    n = k * m
    mc = min(min_cluster, k, m)
    none = np.zeros((0, 4), np.int64)
    if not support.any():
        return none
    if support.all():
        return np.array([[0, 0, k, m]], np.int64)
    F = 2 * (_bits_for(k) + _bits_for(m))
    best = (_plan(support, none, F, value_bits)[0], none)
    search = _Search(support, _Costs(F, value_bits, 0.0, mc))
    # first guess of p: the nonzeros outside the core will be the scattered points
    p: float | None = _position_bits(int(np.count_nonzero(support & ~search.core)), n)
    for _ in range(2):
        if p is None:
            break
        search.costs.p = p
        rects = _merge_touching(search.run(int(math.floor((F + value_bits * mc * mc) / (value_bits + p))) + 1,
                                           full_only))
        if not len(rects):
            break
        bits, scattered = _plan(support, rects, F, value_bits)
        if bits < best[0]:
            best = (bits, rects)
        p_next = _position_bits(scattered.size, n)  # what the plan really leaves scattered
        p = p_next if abs(p_next - p) > 0.75 else None
    return best[1]


