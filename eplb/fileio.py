"""File input and output: every file eplb reads is checked before it is read, every file it
writes appears whole or not at all.

Input: :func:`read_input` is the one way a file eplb is given gets read. It refuses anything but a
regular file (a FIFO, a device, a folder, a socket, or a symlink to one of them) before opening it,
and a file larger than the caller's bound before reading it; it reads at most the bound plus one
byte, so a file that grows meanwhile cannot exceed it either. The caller parses the bytes.
:func:`map_input` checks a file the same way and maps it instead (read-only), so a large trace
costs page cache, which the kernel can drop, not memory the process holds. Whatever is read whole
or allocated from an input is first checked against :func:`memory_headroom`, what this process
can still have (physical memory, its cgroup's limit, its address-space limit), so a request for
more ends in one line saying how much more, not in a MemoryError.

Output: a writer fills a temporary file in the target's folder; only when it has finished is the
file flushed to disk and renamed over the target. A write that fails or is interrupted (an
exception, Ctrl-C) leaves the previous file, or nothing, never a truncated one. Only regular files
are replaced: a symlink, folder, device node, FIFO or socket at the target is refused, since
renaming over it would silently swap it for a regular file. A replaced file keeps its permission
bits; a new one gets 0644. A temporary name carries its writer's process id, so one left by a
process that was killed (``kill -9``) is removed by the next write to the same target.

:class:`OutputSet` stages several files and renames them together at the end of a ``with`` block,
so a command that writes a trace and its JSON report leaves both or neither. Given a ``folder``, it
writes the files inside that folder into a temporary sibling folder and commits them with one
rename of the folder (an atomic exchange with the old one), so a reader sees the old set or the new
set, never a mix of the two, whenever the process is stopped.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import secrets
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

NEW_FILE_MODE = 0o644
"""Permission bits of a file that did not exist before."""
READ_CHUNK = 64 << 20
"""Bytes read at a time from a file that grew after it was measured."""


# ---- input ---------------------------------------------------------------------------------------
class InputFileError(ValueError):
    """An input path that is not a regular file, cannot be read, or holds more than its reader takes."""


class MemoryLimitError(ValueError):
    """An input, or what a flag sizes, that needs more memory than this process can have."""


def _proc_kib(field: str) -> int | None:
    """A ``kB`` field of /proc/self/status (VmSize, ...), in bytes; None where there is none."""
    with suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return None


def _cgroup_headroom() -> int | None:
    """What this process's cgroup may still use: v2's ``memory.max`` less ``memory.current``, or
    v1's ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``; None without a limit."""
    with suppress(OSError, ValueError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, where = line.split(":", 2)
            if controllers == "":
                folder, names = Path("/sys/fs/cgroup", where.lstrip("/")), ("memory.max", "memory.current")
            elif "memory" in controllers.split(","):
                folder = Path("/sys/fs/cgroup/memory", where.lstrip("/"))
                names = ("memory.limit_in_bytes", "memory.usage_in_bytes")
            else:
                continue
            if not (folder / names[0]).exists():
                continue
            limit = (folder / names[0]).read_text().strip()
            if limit != "max" and int(limit) < 1 << 60:  # v1 says "no limit" with a huge number
                return max(0, int(limit) - int((folder / names[1]).read_text()))
    return None


def memory_headroom(*, mapped: bool = False) -> tuple[int, str]:
    """The bytes this process can still allocate, and what bounds them, in words.

    The least of: the machine's physical memory, what its cgroup's ``memory.max`` leaves, and what
    its address-space limit (``RLIMIT_AS``) leaves above what it maps already. ``mapped``: for a
    read-only file mapping, whose pages are page cache the kernel may drop, only the address-space
    limit counts.
    """
    bounds: list[tuple[int, str]] = []
    if not mapped:
        with suppress(OSError, ValueError, AttributeError):
            bounds.append((os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "the machine's memory"))
        cgroup = _cgroup_headroom()
        if cgroup is not None:
            bounds.append((cgroup, "what the cgroup's memory.max leaves"))
    with suppress(ImportError, OSError, ValueError):
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        used = _proc_kib("VmSize")
        if soft != resource.RLIM_INFINITY and used is not None:
            bounds.append((max(0, soft - used), "what the address-space limit (RLIMIT_AS) leaves"))
    return min(bounds, default=(1 << 62, "no known limit"))


def format_size(nbytes: float) -> str:
    """Bytes for a message: ``512 B``, ``3.1 MiB``, ``10.0 GiB``."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{int(nbytes)} B"


def check_memory(nbytes: int, what: str, *, mapped: bool = False) -> None:
    """Refuse ``what`` (``"--steps 10000000 of deepseek-v3"``, ``"PATH: the trace's counts"``)
    when it needs more than :func:`memory_headroom` leaves: MemoryLimitError saying both sizes."""
    headroom, bound = memory_headroom(mapped=mapped)
    if nbytes > headroom:
        raise MemoryLimitError(
            f"{what} needs {format_size(nbytes)} of memory, more than this process can have: "
            f"{format_size(headroom)}, {bound}"
        )


def _special_kind(mode: int) -> str | None:
    """What a non-regular file is, in words (None for a regular file)."""
    if stat.S_ISREG(mode):
        return None
    for test, kind in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a plain file"


def _check_input(path: Path, st: os.stat_result, limit: int, what: str) -> None:
    kind = _special_kind(st.st_mode)
    if kind is not None:
        shown = f"{path} (a symlink to {os.path.realpath(path)})" if os.path.islink(path) else str(path)
        raise InputFileError(f"{shown}: the {what} is {kind}, not a regular file")
    if st.st_size > limit:
        raise InputFileError(f"{path}: the {what} holds {st.st_size} bytes, more than the {limit} it may")


def _open_input(path: Path, limit: int, what: str) -> tuple[int, os.stat_result]:
    """An open descriptor of the regular file at ``path`` and its fstat, checked before the open
    and again after it (:func:`read_input`'s checks)."""
    try:
        _check_input(path, os.stat(path), limit, what)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"{what} not found", str(path)) from None
    # Non-blocking: should a FIFO replace the file after the stat, the open still returns and the
    # fstat below refuses it.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        _check_input(path, st, limit, what)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_input(path: str | Path, *, limit: int, what: str = "input file", head: int | None = None) -> bytes:
    """The bytes of the regular file at ``path`` (symlinks followed), at most ``limit`` of them.

    ``what`` names the input in messages ("trace file", "placement file"). A FIFO, device, folder
    or socket is refused (InputFileError, a ValueError naming the file) before it is opened:
    opening a FIFO with no writer blocks, and a device may never end. A file larger than
    ``limit`` is refused before it is read, and at most ``limit + 1`` bytes are ever read, so one
    that grows meanwhile is refused too. A missing file is a FileNotFoundError ("PATH: WHAT not
    found" on the command line). ``head``: only the first ``head`` bytes (to tell a format by).
    """
    path = Path(path)
    fd, st = _open_input(path, limit, what)
    with os.fdopen(fd, "rb") as f:
        if head is not None:
            return f.read(head)
        check_memory(st.st_size, f"{path}: reading the {what} whole")
        try:
            data = f.read(st.st_size + 1)
            if len(data) > st.st_size:  # it grew since the fstat (or the size was not known)
                parts, total = [data], len(data)
                while total <= limit:
                    chunk = f.read(min(READ_CHUNK, limit + 1 - total))
                    if not chunk:
                        break
                    parts.append(chunk)
                    total += len(chunk)
                data = b"".join(parts)
        except OSError as exc:
            raise InputFileError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
        except MemoryError:
            raise MemoryLimitError(
                f"{path}: the {what} ({format_size(st.st_size)}) does not fit in this process's memory"
            ) from None
    if len(data) > limit:
        raise InputFileError(f"{path}: the {what} grew past the {limit} bytes it may hold while being read")
    return data


def map_input(path: str | Path, *, limit: int, what: str = "input file") -> mmap.mmap | bytes:
    """The regular file at ``path``, checked as :func:`read_input` checks it, mapped read-only
    (an empty file: ``b""``, which cannot be mapped). Slices of the map are bytes; arrays made
    with ``np.frombuffer`` share its pages and keep it open. A file whose size the address-space
    limit cannot hold is a MemoryLimitError before the mapping is tried; one the kernel still
    refuses to map is one too."""
    path = Path(path)
    fd, st = _open_input(path, limit, what)
    try:
        if st.st_size == 0:
            return b""
        check_memory(st.st_size, f"{path}: mapping the {what}", mapped=True)
        try:
            return mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ)
        except (OSError, MemoryError) as exc:
            if isinstance(exc, OSError) and exc.errno not in (errno.ENOMEM, errno.EOVERFLOW):
                raise InputFileError(f"{path}: cannot map the {what} ({exc.strerror or exc})") from None
            raise MemoryLimitError(
                f"{path}: the {what} ({format_size(st.st_size)}) cannot be mapped into this process's "
                "memory (its address space is too small)"
            ) from None
    finally:
        os.close(fd)


def json_error_text(exc: ValueError) -> str:
    """What a JSON decoding error says, for a one-line message: Python's integer digit limit
    (a number of 4300 digits or more) ends in advice to raise the limit, which is dropped."""
    return str(exc).split("; use ")[0]


SAFETENSORS_DTYPES = {
    "BOOL": "?", "U8": "u1", "I8": "i1", "U16": "<u2", "I16": "<i2", "U32": "<u4", "I32": "<i4",
    "U64": "<u8", "I64": "<i8", "F16": "<f2", "F32": "<f4", "F64": "<f8",
}  # fmt: skip
"""safetensors' dtype names, as NumPy spells them (little-endian, as the format stores them)."""


@dataclass(frozen=True)
class _Tensor:
    """One tensor a safetensors header declares."""

    dtype: str
    shape: list[int]
    begin: int
    """First byte, from the start of the file."""
    end: int


def _safetensors_entries(data: bytes | mmap.mmap) -> tuple[dict[str, str], dict[str, _Tensor]]:
    """The metadata and each tensor's dtype, shape and byte range, from the header alone."""
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes, too short for a safetensors file")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise ValueError(f"the safetensors header declares {size} bytes but the file holds {len(data) - 8}")
    try:
        header = json.loads(data[8 : 8 + size])
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError included
        raise ValueError(f"the safetensors header is not JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise ValueError("the safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("the safetensors metadata must map names to strings")
    tensors: dict[str, _Tensor] = {}
    held = len(data) - 8 - size
    for name, info in header.items():
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r} declares no valid shape")
        offsets = info.get("data_offsets")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= held
        ):
            raise ValueError(f"tensor {name!r} declares data outside the {held} bytes the file holds")
        dtype = info.get("dtype")
        tensors[name] = _Tensor(str(dtype), shape, 8 + size + offsets[0], 8 + size + offsets[1])
    return meta, tensors


def safetensors_header(data: bytes | mmap.mmap) -> tuple[dict[str, str], dict[str, list[int]]]:
    """The metadata and the tensor shapes that a safetensors file's bytes declare, from its header
    alone, so a reader checks them before any tensor is decoded. ValueError (saying what is
    wrong, for the caller to prefix with the file's name) when the bytes start with no such header."""
    meta, tensors = _safetensors_entries(data)
    return meta, {name: t.shape for name, t in tensors.items()}


def safetensors_views(data: bytes | mmap.mmap, names: Iterable[str]) -> dict[str, Any]:
    """Tensors ``names`` of a safetensors file's bytes as read-only NumPy arrays that share
    ``data``'s memory (a mapped file's pages: nothing is copied), after checking each one's dtype
    and that its byte range holds exactly its shape. ValueError as :func:`safetensors_header`."""
    import numpy as np

    _, tensors = _safetensors_entries(data)
    views: dict[str, Any] = {}
    for name in names:
        t = tensors[name]
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype!r}, which eplb does not read")
        dtype = np.dtype(SAFETENSORS_DTYPES[t.dtype])
        count = 1
        for d in t.shape:
            count *= d
        if count * dtype.itemsize != t.end - t.begin:
            raise ValueError(
                f"tensor {name!r} declares shape {t.shape} of {t.dtype} ({count * dtype.itemsize} bytes) "
                f"but holds {t.end - t.begin} bytes"
            )
        if count == 0:  # frombuffer refuses an offset at the very end
            views[name] = np.empty(t.shape, dtype)
        else:
            views[name] = np.frombuffer(data, dtype=dtype, count=count, offset=t.begin).reshape(t.shape)
    return views


# ---- output --------------------------------------------------------------------------------------
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


def _alive(pid: int) -> bool:
    """Whether process ``pid`` may still be running (when unsure: yes, so nothing of it is removed)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, or no way to ask
        return True
    return True


def _remove(path: Path) -> None:
    """Remove a file or a folder tree, if it is there (best effort)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with suppress(OSError):
            path.unlink()


def _temp_name(target: Path, token: str, kind: str) -> Path:
    """``.NAME.PID.TOKEN.KIND`` beside ``target``: the process id lets a later run tell a live
    writer's temporary from one that a killed writer left."""
    return target.parent / f".{target.name}.{os.getpid()}.{token}.{kind}"


def sweep_stale(target: str | Path) -> None:
    """Remove what writers of ``target`` left beside it when they were killed (``kill -9``): their
    temporary files and folders (``.NAME.PID.TOKEN.tmp``); where one died between the two renames
    of a folder commit without an atomic exchange, its old folder (``.NAME.PID.TOKEN.old``) is put
    back first. Only what processes no longer running left is touched; failures are ignored (the
    next run tries again)."""
    target = Path(target)
    prefix = f".{target.name}."
    try:
        names = os.listdir(target.parent)
    except OSError:
        return
    for name in sorted(names, key=lambda n: not n.endswith(".old")):  # put an old folder back first
        parts = name[len(prefix) :].split(".") if name.startswith(prefix) else []
        if len(parts) != 3 or not parts[0].isdigit() or parts[2] not in ("tmp", "old"):
            continue
        if _alive(int(parts[0])):
            continue
        path = target.parent / name
        if parts[2] == "old" and not os.path.lexists(target):
            with suppress(OSError):
                os.rename(path, target)
                continue
        _remove(path)


@dataclass(frozen=True)
class _Staged:
    target: Path
    """Where the file goes."""
    tmp: Path
    """The temporary file (in the target's folder, or in a staged folder) that the writer fills."""
    mode: int
    """Permission bits the target gets."""


def _target_mode(target: Path) -> int:
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        return NEW_FILE_MODE


def _make_parents(target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputPathError(
            f"{target}: cannot create folder {target.parent} ({exc.strerror or exc})"
        ) from None


def _stage(target: str | Path, parents: bool) -> _Staged:
    target = check_output_path(target, parents=parents)
    if parents:
        _make_parents(target)
    sweep_stale(target)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise OutputPathError(
            f"{target}: cannot create a file in {target.parent} ({exc.strerror or exc})"
        ) from None
    os.close(fd)
    return _Staged(target, Path(name), _target_mode(target))


def _flush(staged: _Staged) -> None:
    """Make a staged file's content durable and give it the target's permission bits."""
    fd = os.open(staged.tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(staged.tmp, staged.mode)


def _commit(staged: _Staged) -> None:
    _flush(staged)
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


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``);
    False where the system or the file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # a C library older than glibc 2.28
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _replaceable_folder(folder: Path) -> Path:
    """The folder (symlinks resolved) that a folder set replaces, refused when it cannot be."""
    real = Path(os.path.realpath(folder))
    if real.exists() and not real.is_dir():
        raise OutputPathError(f"{folder} is not a folder")
    cwd = Path.cwd().resolve()
    if real == real.parent or real == cwd or real in cwd.parents:
        raise OutputPathError(
            f"{folder} holds the current folder; the folder is replaced as a whole, so give "
            "the files a folder of their own"
        )
    return real


def _ours(entry: str, names: Iterable[str]) -> bool:
    """An entry a folder set may replace: one of its names, or an older writer's temporary of one."""
    return any(entry == n or (entry.startswith(f".{n}.") and entry.endswith(".tmp")) for n in names)


def check_output_folder_set(folder: str | Path, names: Iterable[str]) -> None:
    """Refuse to replace ``folder`` with a set of files ``names`` (:class:`OutputSet` with that
    folder) unless it is absent or a folder holding only those names (regular files), in an
    existing folder or one that could be made; nothing is written. Whatever else it held would
    be lost with the old folder, so anything else there is refused, naming it."""
    names = list(names)
    real = _replaceable_folder(Path(folder))
    for name in names:
        check_output_path(real / name, parents=True)
    try:
        entries = sorted(os.listdir(real))
    except FileNotFoundError:
        return
    foreign = [e for e in entries if not _ours(e, names)]
    if foreign:
        raise OutputPathError(
            f"{folder} holds {foreign[0]}"
            + (f" and {len(foreign) - 1} more" if len(foreign) > 1 else "")
            + f", not one of the files written there ({', '.join(names)}); the folder is replaced "
            "as a whole, so give them a folder of their own (or move what else it holds)"
        )


class _FolderSet:
    """The files of one folder, written into a temporary sibling folder and committed by one
    rename of it: an atomic exchange with the old folder, which then goes."""

    def __init__(self, folder: Path, parents: bool) -> None:
        self.folder = folder
        self.real = _replaceable_folder(folder)
        self.parents = parents
        self.files: list[_Staged] = []
        self.tmp: Path | None = None
        self.old: Path | None = None

    def holds(self, target: Path) -> bool:
        """Whether ``target`` lies in the folder; one in a subfolder of it is refused."""
        real_target = Path(os.path.realpath(target.parent)) / target.name
        if real_target.parent == self.real:
            return True
        if self.real in real_target.parents:
            raise OutputPathError(
                f"{target}: inside a subfolder of {self.folder}, which is replaced as a whole; "
                "name a file directly in it, or one outside it"
            )
        return False

    def stage(self, target: Path) -> _Staged:
        old_file = check_output_path(self.real / target.name, parents=True)
        if self.tmp is None:
            if self.parents:
                _make_parents(self.real)
            elif not self.real.parent.is_dir():
                raise OutputPathError(f"{self.folder}: folder {self.real.parent} does not exist")
            sweep_stale(self.real)
            token = secrets.token_hex(4)
            tmp = _temp_name(self.real, token, "tmp")
            try:
                os.mkdir(tmp)  # the umask applies, as to any new folder
            except OSError as exc:
                raise OutputPathError(
                    f"{self.folder}: cannot create a folder in {self.real.parent} ({exc.strerror or exc})"
                ) from None
            self.tmp, self.old = tmp, _temp_name(self.real, token, "old")
        staged = _Staged(target, self.tmp / target.name, _target_mode(old_file))
        staged.tmp.touch(exist_ok=False)  # as a file staged alone, it exists (empty) until written
        self.files.append(staged)
        return staged

    def commit(self) -> None:
        if self.tmp is None:
            return
        for staged in self.files:
            _flush(staged)
        # Again at the end: something may have appeared there while the files were written.
        check_output_folder_set(self.folder, [s.target.name for s in self.files])
        _fsync_folder(self.tmp)
        if not os.path.lexists(self.real):
            os.rename(self.tmp, self.real)
        else:
            os.chmod(self.tmp, stat.S_IMODE(os.stat(self.real).st_mode))
            if not _exchange(self.tmp, self.real):
                # No atomic exchange here: for a moment there is no folder (never a mixed one);
                # discard() or the next run's sweep_stale() puts the old one back if stopped then.
                assert self.old is not None
                os.rename(self.real, self.old)
                os.rename(self.tmp, self.real)
        _fsync_folder(self.real.parent)
        self.discard()  # the temporary name now holds the old folder, if there was one

    def discard(self) -> None:
        """Remove the temporary folders (the new set before its commit, the old one after it)."""
        if self.tmp is None or self.old is None:
            return
        if not os.path.lexists(self.real) and os.path.lexists(self.old):
            os.rename(self.old, self.real)  # stopped between the two renames: the old set stays
        _remove(self.tmp)
        _remove(self.old)
        self.tmp = self.old = None


class OutputSet:
    """Files staged together: renamed into place when the ``with`` block ends without an error,
    all discarded when it raises (KeyboardInterrupt included).

    ``parents``: create a staged file's missing folders (the default of :meth:`stage`).
    ``folder``: the files staged directly in it are committed together by one rename of the
    folder, before the others (each renamed on its own); the folder then holds exactly those
    files (:func:`check_output_folder_set` refuses one holding anything else).
    """

    def __init__(self, *, parents: bool = False, folder: str | Path | None = None) -> None:
        self.parents = parents
        self._folder = None if folder is None else _FolderSet(Path(folder), parents)
        self._staged: list[_Staged] = []
        self._targets: set[Path] = set()

    def prepare(self, targets: Iterable[str | Path | None]) -> None:
        """Before any work: refuse ``targets`` (the files this set will stage; None skipped) that
        cannot be written (:func:`check_output_path`; for the folder's,
        :func:`check_output_folder_set`), and remove what killed writers of them left
        (:func:`sweep_stale`)."""
        inside: list[Path] = []
        outside: list[Path] = []
        for target in targets:
            if target is not None:
                target = Path(target)
                (inside if self._folder is not None and self._folder.holds(target) else outside).append(
                    target
                )
        for target in outside:
            check_output_path(target, parents=self.parents)
        if self._folder is not None:
            check_output_folder_set(self._folder.folder, [t.name for t in inside])
            sweep_stale(self._folder.real)
        for target in outside:
            sweep_stale(target)

    def stage(self, target: str | Path, *, parents: bool | None = None) -> Path:
        """A temporary path to write ``target``'s content to; it becomes ``target`` at commit."""
        target = Path(target)
        if target in self._targets:
            raise OutputPathError(f"{target} is named twice as an output")
        if self._folder is not None and self._folder.holds(target):
            staged = self._folder.stage(target)
        else:
            staged = _stage(target, self.parents if parents is None else parents)
            self._staged.append(staged)
        self._targets.add(target)
        return staged.tmp

    def commit(self) -> None:
        """Rename the folder, then every other staged file, into place (each rename is atomic)."""
        try:
            if self._folder is not None:
                self._folder.commit()
            while self._staged:
                _commit(self._staged[0])
                self._staged.pop(0)
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Remove every staged file not yet committed."""
        if self._folder is not None:
            self._folder.discard()
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
