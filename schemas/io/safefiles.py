"""File safety, in one place: what zeppelin reads, what it writes, and the directories it manages.

**Inputs.** Every input is a regular file (devices, FIFOs and directories are refused before
anything opens them; links are followed and the target decides) and, while a command runs, is
remembered (:func:`tracking_inputs`, :func:`note_input`) so that no output replaces it.

**Outputs.** Every output is written by :func:`atomic_write`: :func:`check_output` first (never over
an input, never over a device or FIFO, a link's target is replaced), then a fresh temporary file
next to the target (created with ``O_CREAT | O_EXCL``, its name known before it exists), renamed
into place on success and removed on any failure, SIGTERM and SIGHUP included
(:mod:`zeppelin.schemas.io.signals`).

**Managed directories** (checkpoint directories, a job's error directory). A managed directory is
opened once (:class:`ManagedDir`, following the path the user gave) and every entry zeppelin
creates, replaces, reads or removes inside it is named relative to that directory's file
descriptor and never followed when it is a symbolic link:

* new files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a link or any existing entry at
  that name is an error, never written through);
* files are replaced by renaming a fresh temporary file over the name, which replaces a link
  itself, not its target (:meth:`ManagedDir.write_atomic`);
* the lock file is opened with ``O_NOFOLLOW`` and must be a regular file with one link;
* removals unlink a link or a file and remove a real directory's tree without following links
  (:meth:`ManagedDir.remove`);
* small metadata files are read with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO cannot block the
  reader), must be regular files and are read up to a bound (:func:`read_small`).

Anything found at a name zeppelin owns that zeppelin did not make (a link, a device, a FIFO) is
refused with one line naming it, or removed where the name is a temporary one of zeppelin's.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ..common import InputError
from .signals import cleanup_signals

__all__ = [
    "MAX_SMALL_FILE",
    "ManagedDir",
    "atomic_write",
    "atomic_write_text",
    "check_input_file",
    "check_output",
    "check_side_file",
    "check_writable_dir",
    "kind_of",
    "note_input",
    "open_temp",
    "place",
    "read_input_bytes",
    "read_small",
    "remove_own",
    "is_null_device",
    "same_file",
    "stat_regular",
    "tracking_inputs",
]

#: largest metadata file (``latest``, a checkpoint's ``state.json``, an error record) read
MAX_SMALL_FILE = 64 << 20

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC  # a fresh file: never an existing entry


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, words in ((stat.S_ISREG, "a regular file"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "not a regular file"


def _why(e: OSError) -> str:
    return e.strerror or e.__class__.__name__


# ---------------------------------------------------------------------------------------------
# Inputs: every input is a regular file, remembered so that no output replaces it
# ---------------------------------------------------------------------------------------------

_INPUTS: list[str] = []  # paths read as input by the running command (see note_input)
_TRACKING = [False]


@contextmanager
def tracking_inputs() -> Iterator[None]:
    """While a command runs: remember every file read as input, so that no output replaces one."""
    _INPUTS.clear()
    _TRACKING[0] = True
    try:
        yield
    finally:
        _TRACKING[0] = False
        _INPUTS.clear()


def note_input(path: str | os.PathLike) -> None:
    """Remember ``path`` as an input of the running command: :func:`atomic_write` refuses to write over it."""
    if not _TRACKING[0]:
        return
    p = os.fspath(path)  # kept as named (messages show it so); compared by device and inode
    if all(os.path.abspath(p) != os.path.abspath(q) for q in _INPUTS):
        _INPUTS.append(p)


def _stat_or_none(path: str | os.PathLike, failure: str, shown: str | os.PathLike) -> os.stat_result | None:
    """``os.stat`` (links followed); None when nothing is there, any other failure as one line
    ``FAILURE: reason`` naming ``shown``."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise InputError(f"{failure}: {_why(e)}", source=shown) from None


def stat_regular(path: str | os.PathLike, what: str = "input", *,
                 missing: str = "file not found") -> os.stat_result:
    """``os.stat`` of a file that must be a regular file (links followed, the target decides): one
    line naming ``path`` when nothing is there (``missing``), when it cannot be looked up, or when it
    is a device, a FIFO or a directory."""
    st = _stat_or_none(path, f"cannot read {what}", path)
    if st is None:
        raise InputError(missing, source=path)
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{what} is {kind_of(st.st_mode)}, not a regular file", source=path)
    return st


def check_input_file(path: str | os.PathLike, what: str = "input") -> Path:
    """Refuse an input that is missing or not a regular file (devices, FIFOs, directories; symlinks
    are followed and the target decides) before anything opens it; note it as an input."""
    p = Path(path)
    stat_regular(p, what)
    note_input(p)
    return p


def read_input_bytes(path: str | os.PathLike, what: str = "input") -> bytes:
    p = check_input_file(path, what)
    try:
        return p.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read {what}: {_why(e)}", source=p) from None


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True when both paths exist and name the same file (symlinks followed)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# Outputs: written atomically, never over an input
# ---------------------------------------------------------------------------------------------

def is_null_device(path: str | os.PathLike | None) -> bool:
    """True when ``path`` itself is the null character device (``-o /dev/null``: discard the output).
    The name is not followed: a symlink, even one to the null device, is not it."""
    if path is None or not str(path):
        return False
    try:
        st, null = os.lstat(path), os.stat(os.devnull)
    except OSError:
        return False
    return stat.S_ISCHR(st.st_mode) and stat.S_ISCHR(null.st_mode) and st.st_rdev == null.st_rdev


def check_output(path: str | os.PathLike, inputs: Any = (), what: str = "output", *, replaces: bool = False) -> Path:
    """Refuse an output path that is the same file as an input (those given and those noted by
    :func:`note_input`), or that exists and is not a regular file (symlinks followed), or whose
    directory is not a directory. ``replaces=True``: the output is meant to replace the input read from
    the same path (``check --update`` rewriting a golden plan). Returns the path to write (a symlink's
    target)."""
    p = Path(path)
    if not str(path) or str(path).endswith(os.sep):
        raise InputError(f"{what} path names a directory", source=path)
    st = _stat_or_none(p, f"cannot write {what}", p)
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise InputError(f"{what} path is a directory", source=p)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{what} path is {kind_of(st.st_mode)}, not a regular file", source=p)
        for src in [*(x for x in inputs if x is not None), *_INPUTS]:
            if not replaces and same_file(p, src):
                raise InputError(f"{what} would overwrite an input file ({src})"
                                 if os.path.abspath(os.fspath(src)) != os.path.abspath(p)
                                 else f"{what} would overwrite an input file", source=p)
    elif os.path.islink(p):
        raise InputError(f"{what} path is a dangling symbolic link", source=p)
    target = Path(os.path.realpath(p)) if os.path.islink(p) else p
    parent = target.parent
    pst = _stat_or_none(parent, f"cannot write {what}", p)
    if pst is not None and not stat.S_ISDIR(pst.st_mode):
        raise InputError(f"cannot write {what}: {parent} is not a directory", source=p)
    return target


def check_writable_dir(path: str | os.PathLike, what: str = "output") -> None:
    """Refuse, before any work, an output whose directory (or the nearest one that exists) is on a
    read-only filesystem or not writable: one line naming the path and the errno's text."""
    import errno

    anc = Path(os.path.abspath(path)).parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    try:
        readonly = bool(os.statvfs(anc).f_flag & getattr(os, "ST_RDONLY", 1))
    except OSError as e:
        raise InputError(f"cannot write {what}: {_why(e)}", source=path) from None
    if readonly or not os.access(anc, os.W_OK | os.X_OK):
        raise InputError(f"cannot write {what}: {os.strerror(errno.EROFS if readonly else errno.EACCES)}",
                         source=path)


def _temp_basename(name: str) -> str:
    return f".{name[:40]}.{secrets.token_hex(6)}.tmp"


def open_temp(target: Path, names: list[str]) -> int:
    """A new temporary file next to ``target``, opened for writing (``O_EXCL``: never an existing
    entry). Its name is appended to ``names`` before the file exists, so that a signal in between
    still has it removed; a name another file took is tried again with a new one."""
    while True:
        names.append(str(target.parent / _temp_basename(target.name)))
        try:
            return os.open(names[-1], _NEW_FILE, 0o600)
        except FileExistsError:
            names.pop()


def place(tmp: str, target: Path, *, link: bool = False, what: str = "file", busy: str = "in use") -> None:
    """Rename a finished temporary file over ``target``, with the permissions a plain ``open()``
    would have given it (temporary files are created 0600).

    ``link=True`` (a side file zeppelin keeps open and locked, such as a plan stream's chain): the
    file is hard-linked at ``target`` instead, which fails when anything is at that name and never
    follows a link there, and the temporary name is removed. An entry already at ``target`` is
    taken over only when it is a regular file of one link whose ``flock`` is free (left behind by a
    writer that was killed); a locked one is refused with ``busy``, anything else (a symbolic link,
    a FIFO, a hard link to another file) as not zeppelin's."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    if not link:
        os.replace(tmp, target)
        return
    for _ in range(3):
        try:
            os.link(tmp, target, follow_symlinks=False)
            break
        except FileExistsError:
            _clear_stale(target, what, busy)
    else:
        raise InputError(f"{what} keeps reappearing: {busy}", source=target)
    os.unlink(tmp)


def check_side_file(path: str | os.PathLike, what: str, busy: str) -> None:
    """Refuse, before any work, a side file name (see :func:`place`) held by a live writer or by
    something zeppelin did not write; nothing is removed."""
    _clear_stale(Path(path), what, busy, remove=False)


def _clear_stale(path: Path, what: str, busy: str, remove: bool = True) -> None:
    """Remove a side file left by a killed writer (see :func:`place`); refuse a live or foreign one."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except FileNotFoundError:
        return
    except OSError:
        st = os.lstat(path)
        raise InputError(f"{what} is {kind_of(st.st_mode)}, not a file zeppelin wrote (remove it)",
                         source=path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{what} is {kind_of(st.st_mode)}, not a file zeppelin wrote (remove it)",
                             source=path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(busy, source=path) from None
        if st.st_nlink != 1:
            raise InputError(f"{what} has {st.st_nlink} hard links, not a file zeppelin wrote (remove it)",
                             source=path)
        if remove:
            remove_own(path, (st.st_dev, st.st_ino))
    finally:
        os.close(fd)


def remove_own(path: str | os.PathLike, ident: tuple[int, int]) -> None:
    """Unlink ``path`` if it still names the file ``ident`` (device, inode) that zeppelin made there:
    a file another writer has put at the name since, or a link planted there, is left alone."""
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == ident and stat.S_ISREG(st.st_mode):
            os.unlink(path)
    except OSError:
        pass


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", *, inputs: Any = (), what: str = "output",
                 replaces: bool = False) -> Iterator[Any]:
    """Write to a temporary file next to ``path`` and rename it into place on success.

    The one way zeppelin writes a file: :func:`check_output` runs first (never over an input, never over
    a device or FIFO, a symlink's target is replaced); any ``OSError`` becomes an :class:`InputError`
    naming the path and the reason; on any exception, SIGTERM and SIGHUP included, the temporary file
    is removed and ``path`` is left untouched.
    """
    target = check_output(path, inputs, what, replaces=replaces)
    shown = Path(path)
    try:
        if not target.parent.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot write {what}: {_why(e)}", source=shown) from None
    tmps: list[str] = []
    try:
        with cleanup_signals() as signals:
            try:
                with os.fdopen(open_temp(target, tmps), mode) as fh:
                    yield fh
                    fh.flush()
                    os.fsync(fh.fileno())
                signals.check()  # a signal swallowed on its way still leaves the output untouched
                place(tmps[0], target)
                tmps.clear()
            except OSError as e:
                raise InputError(f"cannot write {what}: {_why(e)}", source=shown) from None
    finally:
        for tmp in tmps:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def atomic_write_text(path: str | os.PathLike, text: str, *, inputs: Any = (), what: str = "output") -> None:
    with atomic_write(path, inputs=inputs, what=what) as fh:
        fh.write(text)


# ---------------------------------------------------------------------------------------------
# Managed directories: entries named relative to the directory's descriptor, never followed
# ---------------------------------------------------------------------------------------------

def _read_fd(fd: int, limit: int, shown: str | os.PathLike, what: str) -> bytes:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{what} is {kind_of(st.st_mode)}, not a regular file", source=shown)
    if st.st_size > limit:
        raise InputError(f"{what} of {st.st_size:,} bytes is larger than the {limit:,} bytes zeppelin reads",
                         source=shown)
    chunks, got = [], 0
    while True:
        b = os.read(fd, min(1 << 20, limit + 1 - got))
        if not b:
            break
        chunks.append(b)
        got += len(b)
        if got > limit:
            raise InputError(f"{what} is larger than the {limit:,} bytes zeppelin reads", source=shown)
    return b"".join(chunks)


def read_small(path: str | os.PathLike, what: str = "file", *, limit: int = MAX_SMALL_FILE,
               dir_fd: int | None = None, shown: str | os.PathLike | None = None) -> bytes:
    """The bytes of a small metadata file: a regular file (never a link when read relative to a
    managed directory's ``dir_fd``; a FIFO or device is refused without blocking), at most
    ``limit`` bytes. Raises :class:`InputError` (one line)."""
    shown = path if shown is None else shown
    flags = os.O_RDONLY | _CLOEXEC | _NONBLOCK | (_NOFOLLOW if dir_fd is not None else 0)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise InputError(f"{what} not found", source=shown) from None
    except OSError as e:
        if dir_fd is not None:
            try:
                st = os.lstat(path, dir_fd=dir_fd)
                if stat.S_ISLNK(st.st_mode):
                    raise InputError(f"{what} is a symbolic link, not a file zeppelin wrote", source=shown) from None
            except OSError:
                pass
        raise InputError(f"cannot read {what}: {_why(e)}", source=shown) from None
    try:
        return _read_fd(fd, limit, shown, what)
    except OSError as e:
        raise InputError(f"cannot read {what}: {_why(e)}", source=shown) from None
    finally:
        os.close(fd)


class ManagedDir:
    """A directory zeppelin writes into, held open; entries are named relative to its descriptor.

    ``what`` names the directory in messages (``--checkpoint-dir``). The directory is created
    (with its parents) when missing; the path itself may be a link to a directory (the user chose
    it), the entries inside are never followed."""

    def __init__(self, path: str | os.PathLike, what: str = "directory", *, create: bool = True) -> None:
        self.path = Path(path)
        self.what = what
        try:
            if create:
                self.path.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
        except FileExistsError:
            raise InputError(f"{what} is not a directory", source=self.path) from None
        except NotADirectoryError:
            raise InputError(f"{what} is not a directory", source=self.path) from None
        except OSError as e:
            raise InputError(f"{what} cannot be opened ({_why(e)})", source=self.path) from None

    def __enter__(self) -> ManagedDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _shown(self, name: str) -> Path:
        return self.path / name

    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.lstat(name, dir_fd=self.fd)
        except FileNotFoundError:
            return None

    def foreign(self, name: str, st: os.stat_result) -> InputError:
        """The error for an entry at a name zeppelin owns that zeppelin did not make."""
        return InputError(f"{self.what}: {name} is {kind_of(st.st_mode)}, not a file zeppelin wrote (remove it)",
                          source=self.path)

    def create(self, name: str, mode: int = 0o600) -> int:
        """A new file ``name`` opened for writing (fails when anything, a link included, is there)."""
        return os.open(name, _NEW_FILE | _NOFOLLOW, mode, dir_fd=self.fd)

    def open_lock(self, name: str) -> int:
        """The lock file ``name``, created when missing; a link, a non-regular file or a file with
        other hard links is refused (writing the holder's pid must not reach another file)."""
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o644, dir_fd=self.fd)
        except OSError as e:
            st = self.lstat(name)
            if st is not None and not stat.S_ISREG(st.st_mode):
                raise self.foreign(name, st) from None
            raise InputError(f"{self.what}: cannot open its lock file ({_why(e)})", source=self.path) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            if st.st_nlink != 1 and stat.S_ISREG(st.st_mode):
                raise InputError(f"{self.what}: {name} has {st.st_nlink} hard links, not a file zeppelin wrote "
                                 "(remove it)", source=self.path)
            raise self.foreign(name, st)
        return fd

    def write_atomic(self, name: str, data: bytes) -> None:
        """Replace ``name`` with ``data``: a fresh temporary file renamed over it (a link at
        ``name`` is replaced, its target untouched)."""
        tmp = _temp_basename(name)
        fd = self.create(tmp, 0o644)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            tmp = None
        finally:
            if tmp is not None:
                self.remove(tmp)

    def probe_writable(self) -> None:
        """Create and remove a file: raises :class:`InputError` when the directory is not writable."""
        tmp = f".zeppelin-write-test-{secrets.token_hex(6)}"
        try:
            os.close(self.create(tmp))
        except OSError as e:
            raise InputError(f"{self.what} is not writable ({_why(e)})", source=self.path) from None
        self.remove(tmp)

    def mkdir(self, name: str) -> Path:
        """A new, empty directory ``name`` (whatever was at that name is removed first)."""
        self.remove(name)
        os.mkdir(name, 0o755, dir_fd=self.fd)
        return self.path / name

    def remove(self, name: str) -> None:
        """Remove ``name``: a link or file is unlinked, a directory's tree removed without
        following any link; nothing there is fine."""
        st = self.lstat(name)
        if st is None:
            return
        try:
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=self.fd)
            else:
                os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst`` inside the directory (``dst`` is removed first: a link there is
        unlinked, not followed)."""
        self.remove(dst)
        os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def read_small(self, name: str, what: str, limit: int = MAX_SMALL_FILE) -> bytes:
        return read_small(name, what, limit=limit, dir_fd=self.fd, shown=self._shown(name))

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))
