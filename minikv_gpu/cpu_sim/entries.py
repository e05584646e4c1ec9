"""The simulator's on-disk cache entries, each checked before it is used (issue 25).

A compiled module (``<key>.so``), its kernel list (``<key>.json``) and the runtime objects
(``runtime-<key>-*.o``) are written atomically, but a disk error, a full disk in an older version,
a copy between machines or a hand edit can still leave a file whose bytes are not what was built.
Loading such a ``.so`` fails in ``dlopen`` or crashes; linking such a ``.o`` fails with a linker
message that names no cache file; a broken ``.json`` raised ``JSONDecodeError``. Every later run hit
the same entry, since its key did not change.

So each entry has a sidecar ``<name>.sha256`` holding the digest of its bytes, written after the
entry. ``intact(path)`` says whether the entry and its digest agree; an entry that exists but does
not agree (or lacks its digest) is reported once as a ``RuntimeWarning`` naming the file, removed,
and the caller builds it again. The digest costs one sha256 over a file of a few hundred KB.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def intact(path: Path) -> bool:
    """Whether the cache entry ``path`` exists and matches its recorded digest. A corrupt one (bytes that
    differ from the digest, a missing or unreadable digest) is reported, removed, and False returned."""
    digest = _digest_path(path)
    if not path.exists() and not digest.exists():
        return False
    try:
        recorded = digest.read_text().strip()
        if file_digest(path) == recorded:
            return True
        why = "its bytes differ from the sha256 recorded when it was built"
    except OSError as e:  # one of the two is missing or unreadable
        why = f"{type(e).__name__}: {e.strerror or e}"
    warnings.warn(f"minikv simulator cache: {path} is corrupt ({why}); removed it and rebuilding",
                  RuntimeWarning, stacklevel=3)
    for p in (path, digest):
        p.unlink(missing_ok=True)
    return False


def record(path: Path, write_atomic) -> None:
    """Record the digest of the entry just written at ``path`` (``write_atomic(path, write)``: the cache's
    atomic writer), so that the next ``intact`` can check it."""
    text = file_digest(path)
    write_atomic(_digest_path(path), lambda tmp: tmp.write_text(text))


def report_unreadable(path: Path, error: Exception) -> None:
    """An entry that matched its digest yet could not be read (an entry from an older format): reported
    and removed like a corrupt one."""
    warnings.warn(f"minikv simulator cache: {path} cannot be read ({type(error).__name__}: {error}); "
                  "removed it and rebuilding", RuntimeWarning, stacklevel=3)
    for p in (path, _digest_path(path)):
        p.unlink(missing_ok=True)
