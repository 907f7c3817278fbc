"""Latency and inverse bandwidth of one collective from timed points: t(n) = alpha + beta * n.

Points span several decades of message size, so the fit minimises the *relative* error (each point
weighted by 1 / t): a plain least-squares line would be decided by the largest messages alone and
leave the small ones, whose time is mostly latency, off by multiples.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Curve:
    """t(bytes) = alpha_s + beta_s_per_byte * bytes for one collective at one group size; `max_error`
    is the largest relative residual of the points it was fitted to (the claim's error band)."""

    alpha_s: float
    beta_s_per_byte: float
    max_error: float = 0.0

    def seconds(self, bus_bytes: float, messages: float = 1.0) -> float:
        """Time of `messages` calls moving `bus_bytes` in total."""
        return messages * self.alpha_s + self.beta_s_per_byte * bus_bytes

    @property
    def bandwidth_gbps(self) -> float:
        """The asymptotic bandwidth, GB/s."""
        return 1e-9 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else float("inf")


def fit_curve(points: list[tuple[float, float]]) -> Curve:
    """The relative-least-squares line through (bytes, seconds) points, alpha and beta kept >= 0."""
    if len(points) < 2:
        raise ValueError(f"a latency/bandwidth fit needs at least 2 message sizes, got {len(points)}.")
    # minimise sum(((alpha + beta n) - t)^2 / t^2): weighted least squares with weights 1 / t^2
    w = [1.0 / t**2 for _, t in points]
    sw = sum(w)
    swn = sum(wi * n for wi, (n, _) in zip(w, points))
    swnn = sum(wi * n * n for wi, (n, _) in zip(w, points))
    swt = sum(wi * t for wi, (_, t) in zip(w, points))
    swnt = sum(wi * n * t for wi, (n, t) in zip(w, points))
    det = sw * swnn - swn * swn
    alpha = (swnn * swt - swn * swnt) / det if det else 0.0
    beta = (sw * swnt - swn * swt) / det if det else 0.0
    if alpha < 0:  # pure bandwidth: the line through the origin
        alpha, beta = 0.0, swnt / swnn
    if beta < 0:  # pure latency: the weighted mean time
        alpha, beta = swt / sw, 0.0
    curve = Curve(alpha, beta)
    error = max(abs(curve.seconds(n) - t) / t for n, t in points)
    return Curve(alpha, beta, error)
