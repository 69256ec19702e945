"""dturbo: Bayesian federated model compression with D-Turbo-VBI (see SPEC.md)."""

__version__ = "0.1.0"
