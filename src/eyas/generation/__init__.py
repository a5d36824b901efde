"""Generation backends that talk to serving engines (the in-process transformers backend is in stages/generate.py)."""
