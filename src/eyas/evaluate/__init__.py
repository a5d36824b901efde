"""Evaluation: the reference speculative decoder (acceptance length, lossless check)."""
