"""Atomic file output: every file eplb writes appears whole or not at all.

A writer fills a temporary file in the target's folder; only when it has finished is the file
flushed to disk and renamed over the target. A write that fails or is interrupted (an exception,
Ctrl-C) leaves the previous file, or nothing, never a truncated one. Only regular files are
replaced: a symlink, folder, device node, FIFO or socket at the target is refused, since renaming
over it would silently swap it for a regular file. A replaced file keeps its permission bits; a
new one gets 0644.

:class:`OutputSet` stages several files and renames them together at the end of a ``with`` block,
so a command that writes a trace and its JSON report leaves both or neither.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

NEW_FILE_MODE = 0o644
"""Permission bits of a file that did not exist before."""


class OutputPathError(ValueError):
    """An output path that cannot be written: a folder, a special file, a missing folder..."""


def check_output_path(path: str | Path, *, parents: bool = False) -> Path:
    """Refuse ``path`` unless it is absent or a regular file, in an existing folder.

    With ``parents`` a missing folder is fine when it could be created (nothing is created
    here). Returns ``path`` as a Path.
    """
    path = Path(path)
    folder = path.parent
    if parents:
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
    if not folder.exists():
        raise OutputPathError(f"{path}: folder {folder} does not exist")
    if not folder.is_dir():
        raise OutputPathError(f"{path}: {folder} is not a folder")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise OutputPathError(f"{path}: cannot inspect ({exc.strerror or exc})") from None
    if stat.S_ISLNK(mode):
        raise OutputPathError(f"{path} is a symlink; refusing to replace it (name its target instead)")
    if stat.S_ISDIR(mode):
        raise OutputPathError(f"{path} is a folder; give a file name")
    if not stat.S_ISREG(mode):
        raise OutputPathError(
            f"{path} is not a regular file (a device, FIFO or socket); refusing to replace it"
        )
    return path


@dataclass(frozen=True)
class _Staged:
    target: Path
    """Where the file goes."""
    tmp: Path
    """The temporary file in the target's folder that the writer fills."""
    mode: int
    """Permission bits the target gets."""


def _stage(target: str | Path, parents: bool) -> _Staged:
    target = check_output_path(target, parents=parents)
    if parents:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputPathError(
                f"{target}: cannot create folder {target.parent} ({exc.strerror or exc})"
            ) from None
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = NEW_FILE_MODE
    try:
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise OutputPathError(
            f"{target}: cannot create a file in {target.parent} ({exc.strerror or exc})"
        ) from None
    os.close(fd)
    return _Staged(target, Path(name), mode)


def _commit(staged: _Staged) -> None:
    fd = os.open(staged.tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(staged.tmp, staged.mode)
    check_output_path(staged.target)  # again: something may have appeared there meanwhile
    os.replace(staged.tmp, staged.target)
    _fsync_folder(staged.target.parent)


def _discard(staged: _Staged) -> None:
    staged.tmp.unlink(missing_ok=True)


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable (best effort: some file systems refuse a folder fsync)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class OutputSet:
    """Files staged together: renamed into place when the ``with`` block ends without an error,
    all discarded when it raises (KeyboardInterrupt included).

    ``parents``: create a staged file's missing folders (the default of :meth:`stage`).
    """

    def __init__(self, *, parents: bool = False) -> None:
        self.parents = parents
        self._staged: list[_Staged] = []

    def stage(self, target: str | Path, *, parents: bool | None = None) -> Path:
        """A temporary path to write ``target``'s content to; it becomes ``target`` at commit."""
        if any(s.target == Path(target) for s in self._staged):
            raise OutputPathError(f"{target} is named twice as an output")
        staged = _stage(target, self.parents if parents is None else parents)
        self._staged.append(staged)
        return staged.tmp

    def commit(self) -> None:
        """Rename every staged file into place (each rename is atomic)."""
        try:
            while self._staged:
                _commit(self._staged[0])
                self._staged.pop(0)
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Remove every staged file not yet committed."""
        for staged in self._staged:
            _discard(staged)
        self._staged.clear()

    def __enter__(self) -> OutputSet:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


@contextmanager
def atomic_path(
    target: str | Path, *, outputs: OutputSet | None = None, parents: bool | None = None
) -> Iterator[Path]:
    """Yield a temporary path to write ``target`` to; when the block ends normally it becomes
    ``target`` (at once, or when ``outputs`` commits); when it raises, it is removed.

    ``parents``: create missing folders (None: as ``outputs`` does, else no).
    """
    if outputs is not None:
        yield outputs.stage(target, parents=parents)
        return
    with OutputSet(parents=bool(parents)) as own:
        yield own.stage(target)


def write_bytes(
    target: str | Path, data: bytes, *, outputs: OutputSet | None = None, parents: bool | None = None
) -> Path:
    """Write ``data`` to ``target`` atomically; returns ``target`` as a Path."""
    with atomic_path(target, outputs=outputs, parents=parents) as tmp:
        tmp.write_bytes(data)
    return Path(target)


def write_text(
    target: str | Path, text: str, *, outputs: OutputSet | None = None, parents: bool | None = None
) -> Path:
    """Write ``text`` (UTF-8) to ``target`` atomically; returns ``target`` as a Path."""
    return write_bytes(target, text.encode(), outputs=outputs, parents=parents)
