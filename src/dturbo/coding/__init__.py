"""Entropy coding of messages: FedPM's masks under the receiver's probabilities (``masks``), and quantised values
under a fitted discretised Gaussian or Laplace (``values``, ``[dturbo.transmission] values_code = "range"``)."""

from .masks import decode_mask, encode_mask, mask_cost_bits
from .values import decode_symbols, encode_symbols

__all__ = ["decode_mask", "decode_symbols", "encode_mask", "encode_symbols", "mask_cost_bits"]
