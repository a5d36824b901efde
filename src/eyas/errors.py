"""The user-facing error type.

Every problem a user can fix (bad config, bad input row, a store that belongs to another run) is raised as
:class:`EyasError` with a message that says what, where (file:line, sample id, field) and how to fix it. The CLI
prints these without a traceback. ``assert`` is kept for internal invariants only.
"""

from __future__ import annotations


class EyasError(Exception):
    """An error the user can act on. The message names what is wrong, where, and how to fix it."""


class ConfigError(EyasError):
    """The configuration is invalid (unknown key, wrong type, inconsistent settings)."""


class DataError(EyasError):
    """An input file or row cannot be used (missing file, malformed JSON, missing field)."""


class StoreError(EyasError):
    """The hidden-state store is inconsistent, corrupt, or belongs to another run/configuration."""
