"""Eyas: train EAGLE-3 speculative-decoding draft models.

Pipeline (one module per stage in ``stages/``, wired by the CLI): prepare -> generate -> tokenize -> vocab -> extract ->
train -> export -> evaluate. ``eyas run CONFIG`` runs them all; each stage also runs alone.
"""

__version__ = "0.1.0"
