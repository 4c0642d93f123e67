"""Files inside directories zeppelin manages (checkpoint directories, a job's error directory).

A managed directory is opened once (:class:`ManagedDir`, following the path the user gave) and
every entry zeppelin creates, replaces, reads or removes inside it is named relative to that
directory's file descriptor and never followed when it is a symbolic link:

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
from pathlib import Path

from .common import InputError

__all__ = ["ManagedDir", "MAX_SMALL_FILE", "kind_of", "read_small"]

#: largest metadata file (``latest``, a checkpoint's ``state.json``, an error record) read
MAX_SMALL_FILE = 64 << 20

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


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
        return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode, dir_fd=self.fd)

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
        tmp = f".{name[:40]}.{secrets.token_hex(6)}.tmp"
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
