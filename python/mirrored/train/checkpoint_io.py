"""The file-level pieces both checkpoint readers share: mirrored's (checkpoint.py) and TensorFlow's (tensorbundle.py).

A module of its own so that neither reader imports the other to open a file.
"""

from __future__ import annotations

import os
import stat

from ..errors import DataLossError, NotFoundError

__all__ = ["CheckpointError", "DamagedCheckpointError", "NotFoundError", "KeyNotFoundError", "damaged",
           "open_regular_file", "read_into"]

_MAGIC = b"MDCKPT\x00"  # a mirrored checkpoint's first bytes (then the format version byte)
_MAX_INDEX = 256 << 20  # bytes: an index of 2 million variables; a larger one is a crafted header


class CheckpointError(ValueError):
    """The file is not a complete ``mirrored`` checkpoint, or does not fit the objects."""


class DamagedCheckpointError(CheckpointError, DataLossError):
    """A checkpoint file that is truncated, corrupted (a checksum mismatch) or in no format mirrored reads: TF's
    ``DataLossError`` for the same files, and the ``CheckpointError`` mirrored raised before."""


def damaged(message: str) -> DamagedCheckpointError:
    return DamagedCheckpointError(None, None, message)


class KeyNotFoundError(NotFoundError, KeyError):
    """``load_variable`` of a name the checkpoint lacks: TensorFlow's ``NotFoundError`` (``md.errors``' one, as
    every missing checkpoint), and a ``KeyError``."""


def open_regular_file(path: str, what: str = "path"):
    """A binary file object for ``path``, refusing anything but a regular file without ever blocking.

    A FIFO or a device (``/dev/zero``) would block a plain ``open`` or feed it
    without end: the type is checked before opening (``O_NONBLOCK``, so a FIFO
    cannot stall the open itself) and again on the opened descriptor.
    """
    label = f"{what}={path!r}" if what.isidentifier() else f"{what} {path!r}"  # an argument, or a description
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise NotFoundError(None, None, f"{label} does not exist; pass a path that save() or write() returned, "
                            "e.g. md.train.latest_checkpoint(directory)") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{label} is {_kind(mode)}, not a regular file (mirrored reads no FIFO or device); use a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # replaced between the stat and the open
            raise CheckpointError(f"{label} is {_kind(mode)}, not a regular file (mirrored reads no FIFO or device); use a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_into(file, offset: int, view: memoryview) -> int:
    """Fill ``view`` from ``file`` at ``offset``; returns the bytes read (fewer only at the end of the file)."""
    file.seek(offset)
    done = 0
    while done < len(view):
        got = file.readinto(view[done:])
        if not got:
            break
        done += got
    return done
