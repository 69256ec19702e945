"""Bayesian layers (local reparameterisation, docs/algorithm.md §6) and the experiment models."""

from .bayes import BayesConv1d, BayesConv2d, BayesConv3d, BayesianLayer, BayesLinear, bayesian_layers
from .convert import BayesianizeError, UnsupportedLayerError, bayesianize
from .models import MODEL_NAMES, build_model, layer_scale

__all__ = [
    "MODEL_NAMES",
    "BayesConv1d",
    "BayesConv2d",
    "BayesConv3d",
    "BayesLinear",
    "BayesianizeError",
    "BayesianLayer",
    "UnsupportedLayerError",
    "bayesian_layers",
    "bayesianize",
    "build_model",
    "layer_scale",
]
