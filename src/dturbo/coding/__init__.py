"""Entropy coding of messages whose receiver holds a probability model (FedPM's masks)."""

from .masks import decode_mask, encode_mask, mask_cost_bits

__all__ = ["decode_mask", "encode_mask", "mask_cost_bits"]
