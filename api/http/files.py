"""Files the server writes for a client (request dumps, profile traces): only under the
configured output root, in folders it made private, never through a link, never over a file.

A control route names a folder; `output_folder` takes it only as the root itself or a folder
one level below it, which is made (mode 0700) if missing. Every file is then created new
(`O_EXCL | O_NOFOLLOW`, mode 0600): a name that exists, or is a symbolic link planted there,
fails instead of being written through.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

NEW_PRIVATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def output_folder(root: Path, requested: str) -> Path:
    """The folder a client asked for, if allowed: ValueError naming why not."""
    path = Path(requested)
    path = path if path.is_absolute() else root / path
    path = Path(os.path.normpath(path))
    if path != root and path.parent != root:
        raise ValueError(
            f"{requested}: output folders are the output root ({root}) or a folder directly in "
            "it (--output-root)"
        )
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ValueError(f"cannot make {path}: {exc.strerror}") from None
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{requested}: not a folder (a link or a file)")
    return path


def write_new(path: Path, data: bytes) -> None:
    """Write a new private file; OSError if the name is taken (a file or a link)."""
    fd = os.open(path, NEW_PRIVATE, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
