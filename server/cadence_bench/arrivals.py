"""When requests are sent: all at once, Poisson at a rate, or a gamma process with a
burstiness factor (as `vllm bench serve`: shape = burstiness, mean gap = 1 / rate;
burstiness 1 is Poisson, below 1 burstier, above 1 more regular)."""

from __future__ import annotations

import math

import numpy as np


def arrival_gaps(count: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds to wait before each request (the first included); rate inf: all zero."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive (inf: all at once), got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * count
    rng = np.random.default_rng(seed)
    # Gamma(k, θ) has mean kθ and variance kθ²: θ = 1 / (rate k) keeps the mean at 1/rate.
    theta = 1.0 / (rate * burstiness)
    return [float(x) for x in rng.gamma(burstiness, theta, size=count)]
