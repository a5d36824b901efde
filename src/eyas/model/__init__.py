"""The EAGLE-3 draft model (one file: ``eagle3.py``). Needs only torch (and transformers' RoPE tables)."""
