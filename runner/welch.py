"""Seed statistics for mpt-report: mean, sample standard deviation and Welch's t interval.

The Student-t quantile is computed here rather than taken from scipy (a 35 MB dependency for one
function): t's CDF is a regularized incomplete beta function, evaluated with its continued fraction
(Lentz's method), and inverted by bisection. Welch's degrees of freedom are fractional, which is why
a table of integer quantiles is not enough.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

_TINY = 1e-300  # keeps Lentz's recurrence away from division by zero
_EPS = 1e-15


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (valid, and fast, for x < (a + 1) / (a + b + 2)):
    1 / (1 + d1 / (1 + d2 / ...)) with d_{2m} = m(b-m)x / ((a+2m-1)(a+2m)) and
    d_{2m+1} = -(a+m)(a+b+m)x / ((a+2m)(a+2m+1)), evaluated by the modified Lentz method."""
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    result = d
    for m in range(1, 10_000):
        for coefficient in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + coefficient * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + coefficient / c
            c = c if abs(c) > _TINY else _TINY
            result *= c * d
        if abs(c * d - 1.0) < _EPS:
            return result
    raise ArithmeticError(f"incomplete beta continued fraction did not converge (a={a}, b={b}, x={x})")


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b  # I_x(a,b) = 1 - I_{1-x}(b,a)


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df > 0 degrees of freedom (df may be fractional)."""
    tail = 0.5 * regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p, to ~1e-12 relative, by bisection on the monotone CDF."""
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:  # grow the bracket: df near 0 has enormous quantiles
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def sample_sd(values: Sequence[float]) -> float | None:
    """Standard deviation with Bessel's correction (n - 1); None below two values."""
    if len(values) < 2:
        return None
    m = mean(values)
    return math.sqrt(math.fsum((v - m) ** 2 for v in values) / (len(values) - 1))


@dataclass(frozen=True)
class Interval:
    """Difference of means b - a with its two-sided confidence interval (Welch)."""

    difference: float
    low: float
    high: float
    df: float | None  # None when both samples have zero spread: the interval is the point itself


def welch_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> Interval:
    """Welch's t interval for mean(b) - mean(a); both samples need at least two values.

    se^2 = s_a^2/n_a + s_b^2/n_b; df by Welch-Satterthwaite:
    se^4 / ((s_a^2/n_a)^2/(n_a-1) + (s_b^2/n_b)^2/(n_b-1))."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError("Welch's interval needs at least two values on each side")
    va, vb = sample_sd(a) ** 2 / len(a), sample_sd(b) ** 2 / len(b)  # type: ignore[operator]
    difference = mean(b) - mean(a)
    if va + vb == 0.0:
        return Interval(difference, difference, difference, None)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = t_quantile(0.5 + confidence / 2.0, df) * math.sqrt(va + vb)
    return Interval(difference, difference - half, difference + half, df)
