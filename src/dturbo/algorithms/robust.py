"""Robust aggregation (``[robust]``, docs/robustness.md): the rule that combines the clients' vectors of a round, as
the trusted frameworks offer it (Flower's FedMedian, FedTrimmedAvg, Krum, Bulyan, and clipping of update norms),
and centered clipping.

Every algorithm hands the same thing to :class:`RobustAggregation`: a matrix with one row per valid upload (the
vector it aggregates: D-Turbo-VBI's mu on the support, sigma and biases before E3/E4, the baselines' weights or
updates, FedPM's masks), the uploads' weights p_t, and the global values the rows move from (for clipping). The
rule returns the combined vector. The plain weighted mean (``rule = "mean"``, no clipping) is the default: an
algorithm then keeps its own sums, so recorded runs are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import RobustConfig


class Rule:
    """A combination of K vectors (rows of ``x``) with weights ``p`` (summing to 1) into one; ``refused``: the
    round's uploads refused before (the hostile ones a rule that assumes some may count as gone)."""

    name = ""

    def combine(self, x: np.ndarray, p: np.ndarray, refused: int = 0) -> np.ndarray:
        raise NotImplementedError

    def for_state(self) -> Rule:
        """The rule for the state outside the Bayesian layers and the BatchNorm statistics: this one, but for centered
        clipping (:meth:`CenteredClip.for_state`)."""
        return self


class Mean(Rule):
    """The weighted mean sum p_t x_t."""

    name = "mean"

    def combine(self, x: np.ndarray, p: np.ndarray, refused: int = 0) -> np.ndarray:
        return p @ x


class Median(Rule):
    """The coordinate-wise median (unweighted, as Flower's FedMedian)."""

    name = "median"

    def combine(self, x: np.ndarray, p: np.ndarray, refused: int = 0) -> np.ndarray:
        return np.median(x, axis=0)


@dataclass
class TrimmedMean(Rule):
    """Per coordinate, the mean after dropping floor(trim * K) values at each end (unweighted, as Flower's
    FedTrimmedAvg), and at least ``byzantine`` less the uploads already refused this round: with fewer than 1 / trim
    uploads, floor(trim * K) is 0 and would trim nothing."""

    trim: float
    byzantine: int = 0
    name = "trimmed_mean"

    def combine(self, x: np.ndarray, p: np.ndarray, refused: int = 0) -> np.ndarray:
        k = x.shape[0]
        cut = min(max(int(np.floor(self.trim * k)), self.byzantine - refused), (k - 1) // 2)
        if cut == 0:
            return x.mean(axis=0)
        return np.sort(x, axis=0)[cut:k - cut].mean(axis=0)


def lengths(x: np.ndarray) -> np.ndarray:
    """The L2 norm of every row of ``x``."""
    return np.sqrt(np.einsum("ij,ij->i", x, x))


def squared_distances(x: np.ndarray) -> np.ndarray:
    """The squared Euclidean distance between every two rows of ``x`` (rounding below 0 raised to 0)."""
    sq = np.einsum("ij,ij->i", x, x)
    return np.maximum(sq[:, None] + sq[None, :] - 2.0 * (x @ x.T), 0.0)


def krum_scores(x: np.ndarray, f: int) -> np.ndarray:
    """Each row's Krum score (Blanchard et al. 2017): the sum of its squared distances to its K - f - 2 nearest
    other rows (at least one)."""
    d = squared_distances(x)
    np.fill_diagonal(d, np.inf)
    near = max(1, x.shape[0] - f - 2)
    return np.sort(d, axis=1)[:, :near].sum(axis=1)


def krum_select(x: np.ndarray, f: int, keep: int) -> np.ndarray:
    """The ``keep`` rows of lowest Krum score (ties: the lower index), in index order."""
    if keep >= x.shape[0]:
        return np.arange(x.shape[0])
    return np.sort(np.argsort(krum_scores(x, f), kind="stable")[:keep])


def too_few(f: int, x: np.ndarray) -> np.ndarray:
    """For a rule that cannot drop the f hostile uploads it assumes among the K rows of ``x``: the coordinate-wise
    mean after dropping f values at each end (at most (K - 1) // 2: the median), which needs no more than K > 2f."""
    return TrimmedMean(0.0, f).combine(x, np.full(x.shape[0], 1.0 / x.shape[0]))


@dataclass
class Krum(Rule):
    """Multi-Krum: the K - f rows of lowest Krum score, combined by their weighted mean (f = ``byzantine`` less the
    uploads already refused this round). Krum needs K >= 2f + 3; with fewer uploads, :func:`too_few`."""

    byzantine: int
    name = "krum"

    def combine(self, x: np.ndarray, p: np.ndarray, refused: int = 0) -> np.ndarray:
        k = x.shape[0]
        f = max(0, self.byzantine - refused)
        if k < 2 * f + 3:
            return too_few(f, x)
        kept = krum_select(x, f, k - f)
        return (p[kept] / p[kept].sum()) @ x[kept]


@dataclass
class Bulyan(Rule):
    """Bulyan (El Mhamdi et al. 2018): theta = K - 2f rows chosen by Krum one at a time, then per coordinate the mean
    of the theta - 2f values nearest their median (f = ``byzantine`` less the uploads already refused this round).
    Bulyan needs K >= 4f + 3; with fewer uploads, :func:`too_few`."""

    byzantine: int
    name = "bulyan"

    def combine(self, x: np.ndarray, p: np.ndarray, refused: int = 0) -> np.ndarray:
        k = x.shape[0]
        f = max(0, self.byzantine - refused)
        if k < 4 * f + 3:
            return too_few(f, x)
        left = list(range(k))
        chosen: list[int] = []
        for _ in range(k - 2 * f):
            best = int(np.argmin(krum_scores(x[left], f))) if len(left) > 1 else 0
            chosen.append(left.pop(best))
        sel = x[np.sort(chosen)]
        beta = max(1, sel.shape[0] - 2 * f)
        med = np.median(sel, axis=0)
        nearest = np.argsort(np.abs(sel - med), axis=0, kind="stable")[:beta]
        return np.take_along_axis(sel, nearest, axis=0).mean(axis=0)


@dataclass
class CenteredClip(Rule):
    """Centered clipping (Karimireddy et al. 2021) from the coordinate-wise median: ``iterations`` times the centre v
    moves by the unweighted mean of the rows' differences from it, each clipped to ``radius`` times their median
    length, so that one row moves v by at most that over K (the paper starts from the last round's momentum; the
    vectors here change length with the support, so the centre starts from a robust estimate of this round's)."""

    radius: float
    iterations: int = 3
    name = "centered_clip"

    def combine(self, x: np.ndarray, p: np.ndarray, refused: int = 0) -> np.ndarray:
        v = np.median(x, axis=0)
        for _ in range(self.iterations):
            d = x - v
            norms = lengths(d)
            tau = self.radius * float(np.median(norms))
            if not tau > 0:  # half the rows or more sit at the centre
                break
            v = v + (d * np.minimum(1.0, tau / np.maximum(norms, np.finfo(np.float64).tiny))[:, None]).mean(axis=0)
        return v

    def for_state(self) -> Rule:
        """The coordinate-wise median: every row moves the centre by a clipped step, so attackers who push the same
        way every round drag a value honest training leaves where it is (a BatchNorm weight) a step each round."""
        return Median()


def make_rule(cfg: RobustConfig) -> Rule:
    """The rule ``[robust] rule`` names, with its settings."""
    if cfg.rule == "median":
        return Median()
    if cfg.rule == "trimmed_mean":
        return TrimmedMean(cfg.trim, cfg.byzantine)
    if cfg.rule == "krum":
        return Krum(cfg.byzantine)
    if cfg.rule == "bulyan":
        return Bulyan(cfg.byzantine)
    if cfg.rule == "centered_clip":
        return CenteredClip(cfg.radius, cfg.iterations)
    return Mean()


def clip(x: np.ndarray, reference: np.ndarray, norm: float) -> np.ndarray:
    """Each row's update from ``reference`` scaled to L2 norm at most ``norm`` (a row inside is left as it is)."""
    step = x - reference
    scale = np.minimum(1.0, norm / np.maximum(lengths(step), np.finfo(np.float64).tiny))
    return reference + step * scale[:, None]


def ordinary(step: np.ndarray, ratio: float | None, short: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Which rows of ``step`` (one update each) have an L2 norm of at most ``ratio`` times the rows' median norm (an
    update stretched to the value bound is orders of magnitude longer than an honest one) and at least ``short``
    times it (an update built from the honest mean, as ALIE and IPM build theirs, is shorter than most honest ones),
    and each row's norm in medians; None: no bound on that side. Every row is kept when the median norm is zero (its
    norms in medians then NaN)."""
    norms = lengths(step)
    median = float(np.median(norms))
    kept = np.ones(step.shape[0], dtype=bool)
    if median <= 0:
        return kept, np.full(step.shape[0], np.nan)
    if ratio is not None:
        kept &= norms <= ratio * median
    if short is not None:
        kept &= norms >= short * median
    return kept, norms / median


def apart(step: np.ndarray, ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """Which rows of ``step`` (one update each) are at least ``ratio`` times the median distance between two rows
    from every other row (colluding attackers send one vector; honest clients' data differ), and each row's distance
    from its nearest other row in those medians. Every row is kept when the median distance is zero or there is one
    row."""
    if step.shape[0] > 1:
        d = np.sqrt(squared_distances(step))
        np.fill_diagonal(d, np.nan)
        median = float(np.nanmedian(d))
        if median > 0:
            nearest = np.nanmin(d, axis=1) / median
            return nearest >= ratio, nearest
    return np.ones(step.shape[0], dtype=bool), np.full(step.shape[0], np.inf)


def cosines(step: np.ndarray, to: str = "median") -> np.ndarray:
    """Each row's cosine with the coordinate-wise median of the rows, or (``to = "mean"``) with the mean of the
    other rows: a row's own share of the mean would lean it that row's way, enough to pass a reversed update when
    honest updates are far from parallel (1 where that centre or the row is zero: no direction to compare)."""
    if to == "median":
        centre = np.median(step, axis=0)
        dots, centre_norms = step @ centre, np.full(step.shape[0], float(np.sqrt(centre @ centre)))
    else:  # the sum of the others is total - row; the 1 / (n - 1) cancels in the cosine
        total = step.sum(axis=0)
        own = np.einsum("ij,ij->i", step, step)
        dots = step @ total - own
        centre_norms = np.sqrt(np.maximum(total @ total - 2.0 * (step @ total) + own, 0.0))
        # what is left of the others' sum after the subtraction's rounding: no direction
        centre_norms[centre_norms <= 1e-9 * float(np.sqrt(own.max(initial=0.0)))] = 0.0
    norms = lengths(step) * centre_norms
    return np.divide(dots, norms, out=np.ones(step.shape[0]), where=norms > 0)


def aligned(step: np.ndarray, min_cosine: float, to: str = "median") -> np.ndarray:
    """Which rows of ``step`` (one update each) have a cosine of at least ``min_cosine`` with the round's median (or
    mean) update (:func:`cosines`): an attacker's reversed update points away from it while an honest majority
    holds it. Every row is kept when none would be."""
    return _some(cosines(step, to) >= min_cosine)


def _some(kept: np.ndarray) -> np.ndarray:
    """``kept``, or every row when it keeps none."""
    return kept if kept.any() else np.ones(kept.shape[0], dtype=bool)


class RobustAggregation:
    """``[robust]`` on a round's matrix of client vectors: :meth:`screen` names the uploads to refuse (their update
    far longer than the round's median, ``refuse_median``, or far shorter, ``refuse_short``; next to another's,
    ``refuse_close``; pointing away from the round's median update, ``min_cosine``), :meth:`combine` clips the rest
    (to ``clip_norm``, then to ``clip_median`` times the round's median update norm) and applies the rule."""

    def __init__(self, cfg: RobustConfig) -> None:
        self.rule = make_rule(cfg)
        self.clip_norm = cfg.clip_norm
        self.clip_median = cfg.clip_median
        self.min_cosine = cfg.min_cosine
        self.cosine_to = cfg.cosine_to
        self.refuse_median = cfg.refuse_median
        self.refuse_short = cfg.refuse_short
        self.refuse_close = cfg.refuse_close

    @property
    def plain(self) -> bool:
        """Whether this is the plain weighted mean: the algorithms then keep their own sums, bit for bit."""
        return isinstance(self.rule, Mean) and self.clip_norm is None and self.clip_median is None and not self.screens

    @property
    def screens(self) -> bool:
        """Whether :meth:`screen` can refuse an upload."""
        return any(v is not None for v in (self.min_cosine, self.refuse_median, self.refuse_short, self.refuse_close))

    def screen(self, rows: list[np.ndarray], reference: np.ndarray | None = None) -> dict[int, str]:
        """The rows (by index) to refuse, with the reason: those whose update from ``reference`` (None: the rows are
        updates) is more than ``refuse_median`` or less than ``refuse_short`` times the median update norm (the
        median upload passes both), then among the rest those within ``refuse_close`` times their median distance of
        another's update, then among the rest, clipped as :meth:`combine` clips them, those whose cosine with the
        median update is below ``min_cosine`` (all of them failing: none refused)."""
        x = self._stack(rows)
        ref = self._reference(reference, x)
        out: dict[int, str] = {}
        left = np.arange(x.shape[0])
        if self.refuse_median is not None or self.refuse_short is not None:
            kept, relative = ordinary(x - ref, self.refuse_median, self.refuse_short)
            for k in np.flatnonzero(~kept):
                ratio = relative[k]
                bound = (f"at most robust.refuse_median = {self.refuse_median:g}" if ratio > 1 else
                         f"at least robust.refuse_short = {self.refuse_short:g}")
                out[int(k)] = f"its update is {ratio:.3g} times the round's median update norm ({bound})"
            left = left[kept]
        if self.refuse_close is not None and left.size:
            kept, nearest = apart(x[left] - ref, self.refuse_close)
            out |= {int(left[k]): f"its update is {nearest[k]:.3g} times the round's median distance between updates "
                                  f"from another upload's (at least robust.refuse_close = {self.refuse_close:g})"
                    for k in np.flatnonzero(~kept)}
            left = left[kept]
        if self.min_cosine is not None and left.size:
            cos = cosines(self._clip(x[left], ref) - ref, self.cosine_to)
            kept = _some(cos >= self.min_cosine)
            centre = "the round's median update" if self.cosine_to == "median" else "the mean of the others' updates"
            out |= {int(left[k]): f"its update has a cosine of {cos[k]:.3f} with {centre} (at least "
                                  f"robust.min_cosine = {self.min_cosine:g})" for k in np.flatnonzero(~kept)}
        return dict(sorted(out.items()))

    def combine(self, rows: list[np.ndarray], p: np.ndarray, reference: np.ndarray | None = None,
                refused: int = 0) -> np.ndarray:
        """The combined vector of ``rows`` (one float vector per upload, all of one length) with weights ``p``;
        ``reference``: the global values the rows move from (None: the rows are updates, from 0); ``refused``: the
        round's uploads refused already (:meth:`screen`'s among them)."""
        x = self._stack(rows)
        w = np.asarray(p, dtype=np.float64)
        return self.rule.combine(self._clip(x, self._reference(reference, x)), w / w.sum(), refused)

    def _clip(self, x: np.ndarray, ref: np.ndarray) -> np.ndarray:
        """The rows of ``x`` with their update from ``ref`` clipped to ``clip_norm``, then to ``clip_median`` times
        the rows' median update norm."""
        if self.clip_norm is not None:
            x = clip(x, ref, self.clip_norm)
        if self.clip_median is not None:
            median = float(np.median(lengths(x - ref)))
            if median > 0:  # a round of equal rows (all zero updates) stays as it is
                x = clip(x, ref, self.clip_median * median)
        return x

    @staticmethod
    def _stack(rows: list[np.ndarray]) -> np.ndarray:
        return np.stack([np.asarray(r, dtype=np.float64).reshape(-1) for r in rows])

    @staticmethod
    def _reference(reference: np.ndarray | None, x: np.ndarray) -> np.ndarray:
        return np.zeros(x.shape[1]) if reference is None else np.asarray(reference, np.float64).reshape(-1)
