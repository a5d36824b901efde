"""The user-facing error type.

Every problem a user can fix (bad config, bad input row, a store that belongs to another run) is raised as
:class:`EyasError` with a message that says what, where (file:line, sample id, field) and how to fix it. The CLI
prints these without a traceback. ``assert`` is kept for internal invariants only.
"""

from __future__ import annotations

import errno


class EyasError(Exception):
    """An error the user can act on. The message names what is wrong, where, and how to fix it."""


class ConfigError(EyasError):
    """The configuration is invalid (unknown key, wrong type, inconsistent settings)."""


class DataError(EyasError):
    """An input file or row cannot be used (missing file, malformed JSON, missing field)."""


class StoreError(EyasError):
    """The hidden-state store is inconsistent, corrupt, or belongs to another run/configuration."""


class DiskFullError(EyasError):
    """A write failed because the disk (or the user's quota) is full. The message names what was being written,
    what is kept, and that the same command resumes once space is freed."""


# what libraries that wrap the OS error in their own type (safetensors, torch.save) still say
_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded")


def is_disk_full(e: BaseException) -> bool:
    """True for an ``OSError`` ENOSPC / EDQUOT, and for another library's error that says so in its message."""
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return not isinstance(e, EyasError) and any(t in str(e) for t in _DISK_FULL_TEXT)
