"""dturbo: Bayesian federated model compression with D-Turbo-VBI (see docs/algorithm.md)."""

__version__ = "0.1.0"
