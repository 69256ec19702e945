"""The federated methods, one module each, and their registry (:mod:`dturbo.algorithms.registry`): a method is its
two halves, its config section and an :class:`~dturbo.protocol.AlgorithmSpec`, made known by :func:`register`."""

from ..protocol import AlgorithmSpec
from .registry import ALGORITHMS, build_algorithm, register, unregister

__all__ = ["ALGORITHMS", "AlgorithmSpec", "build_algorithm", "register", "unregister"]
