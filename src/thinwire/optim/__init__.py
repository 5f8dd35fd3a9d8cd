"""Optimizers that communicate: LAMB, 1-bit Adam, 1-bit LAMB."""
