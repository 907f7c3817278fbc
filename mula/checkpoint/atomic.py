"""Durable, all-or-nothing file writes: the one temp-then-rename helper of the repository.

Every file or directory that must never be seen half-written (checkpoints, manifests, weights files,
exported models, prepared data, tokenizers) is written under a temporary sibling name, flushed to
stable storage, renamed onto its final name (atomic on POSIX) and the parent directory fsync-ed, so
that after a crash the path holds either the old or the complete new content, never a mix.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TMP_PREFIX = ".tmp-"  # hidden, and recognisable so that an interrupted write can be cleaned up


def temp_path(path: str | os.PathLike) -> Path:
    """The temporary sibling ``.tmp-<name>`` that a write of ``path`` goes through (same filesystem)."""
    path = Path(path)
    return path.with_name(f"{TMP_PREFIX}{path.name}")


def fsync_file(path: str | os.PathLike) -> None:
    """Flush one file's data and metadata to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (needed after creating, renaming or deleting files in it)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # some filesystems do not allow opening directories
        return
    try:
        os.fsync(fd)
    except OSError:  # fsync on a directory is not supported everywhere (EINVAL); nothing more we can do
        pass
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync a file, or every file and directory below a directory (bottom-up); a symlink has no data."""
    path = Path(path)
    if path.is_symlink():
        return
    if path.is_file():
        fsync_file(path)
        return
    for root, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            fsync_file(os.path.join(root, name))
        fsync_dir(root)


_libc: Any = None


def sync_filesystem(path: str | os.PathLike) -> None:
    """Flush everything this node wrote to the filesystem holding ``path`` (``syncfs``), or fsync the tree.

    Used for sharded checkpoints, where each rank wrote files the others cannot name: every rank
    calling ``syncfs`` flushes its own writes without knowing which files they were.
    """
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name, use_errno=True) if name else False
    if _libc and hasattr(_libc, "syncfs"):
        fd = os.open(path, os.O_RDONLY)
        try:
            if _libc.syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    fsync_tree(path)


def remove_path(path: str | os.PathLike) -> None:
    """Delete a file, a symlink or a directory tree if it exists."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def replace_path(src: str | os.PathLike, dst: str | os.PathLike, sync: bool = True) -> None:
    """Durably move a finished file, directory or symlink ``src`` onto ``dst``.

    ``sync=False`` when the caller already flushed ``src`` (e.g. every rank ``syncfs``-ed its own
    shards). An existing directory at ``dst`` cannot be renamed over: it is moved aside first and
    deleted once the new one is in place, so a crash in between leaves ``dst`` missing, never mixed.
    """
    src, dst = Path(src), Path(dst)
    if sync:
        fsync_tree(src)
    old = None
    if dst.is_dir() and not dst.is_symlink():
        old = temp_path(dst.with_name(f"old-{dst.name}"))
        remove_path(old)
        os.replace(dst, old)
    os.replace(src, dst)
    fsync_dir(dst.parent)
    if old is not None:
        remove_path(old)


@contextmanager
def atomic_write(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s new content to (a file, a directory or a symlink).

    On a normal exit the content is fsync-ed and renamed onto ``path``; if the body raises, the
    temporary is removed and ``path`` keeps its old content. A temporary left by a crashed earlier
    write of the same path is removed first.
    """
    path = Path(path)
    tmp = temp_path(path)
    remove_path(tmp)
    try:
        yield tmp
        replace_path(tmp, path)
    except BaseException:
        remove_path(tmp)
        raise


def save_torch(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj)`` into the file ``path``, whatever its name.

    Written through an open file: given a path, torch's writer names the archive inside after the file's
    stem and refuses an empty one, which every hidden temporary of a name without an extension has
    (``.tmp-olmoe-weights``).
    """
    import torch

    with open(path, "wb") as fh:
        torch.save(obj, fh)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` so that readers see either the old or the complete new content."""
    with atomic_write(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
