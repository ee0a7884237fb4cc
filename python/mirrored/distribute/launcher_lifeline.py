"""A task of ``mirrored-run`` ends when its launcher dies, whatever started it in between.

The launcher gives every local task the read end of a pipe whose write end
only the launcher holds, and names it in ``MIRRORED_LAUNCHER_FD`` (``fd:inode``).
The end of that pipe (EOF) means the launcher is gone, even after SIGKILL.
``import mirrored`` calls :func:`watch_launcher`, which waits for it on a
daemon thread and then kills the task's process group: the task, the shell
that wraps it (``bash -c 'python train.py; ...'``) and their children. The
launcher's reaper process ends the groups of tasks that never import
mirrored; this watch covers a task that runs under a wrapper the reaper
cannot see through.
"""

from __future__ import annotations

import os
import signal
import stat
import threading

LAUNCHER_FD_VARIABLE = "MIRRORED_LAUNCHER_FD"

__all__ = ["LAUNCHER_FD_VARIABLE", "launcher_fd_value", "watch_launcher"]


def launcher_fd_value(fd: int) -> str:
    """What the launcher puts in MIRRORED_LAUNCHER_FD for the pipe end ``fd``: the fd and the pipe's inode."""
    return f"{fd}:{os.fstat(fd).st_ino}"


def _inherited_pipe() -> int | None:
    """The launcher's pipe, when this process really inherited it.

    The variable outlives the fd (a subprocess started with close_fds gets
    the variable but not the pipe, and the number may then name another
    file): the fd counts only when it is a pipe with the recorded inode.
    """
    fd_text, _, inode = os.environ.get(LAUNCHER_FD_VARIABLE, "").partition(":")
    if not (fd_text.isascii() and fd_text.isdigit() and inode.isascii() and inode.isdigit()):
        return None
    try:
        info = os.fstat(int(fd_text))
    except OSError:
        return None
    return int(fd_text) if stat.S_ISFIFO(info.st_mode) and info.st_ino == int(inode) else None


def _wait_then_end_the_task(fd: int) -> None:
    try:
        while os.read(fd, 4096):  # the launcher never writes: only EOF (or an error) returns
            pass
    except OSError:
        pass
    # The launcher is gone: nobody reports this task's output or ends it later.
    os.killpg(os.getpgrp(), signal.SIGKILL)


_watching = False


def watch_launcher() -> bool:
    """Ends this process's group when the launcher that started it dies; False when not started by one."""
    global _watching
    fd = _inherited_pipe()
    if fd is None or _watching:
        return _watching
    _watching = True
    threading.Thread(target=_wait_then_end_the_task, args=(fd,), name="mirrored-launcher-watch",
                     daemon=True).start()
    return True
