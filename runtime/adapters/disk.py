"""An adapter's files on disk: opened and read with plain reads (never memory-mapped), stamped, and checked.

Why plain reads: a memory-mapped file that a user's tool rewrites in place (``cp`` over it, ``open(p, "wb")``,
``rsync --inplace``: same inode) faults on every page past its new end, and the fault (SIGBUS) kills the
process. A plain read of a file that changes under it only comes up short or returns other bytes, and both
are caught here: :class:`OpenFile` takes the file's stamp when it opens it and again when the caller is done,
and refuses the read (:class:`AdapterError` "changed while it was being read") if the two differ or a read
came up short.

A writer that pauses between its writes leaves the file half old, half new with a stamp that no longer moves;
so a file is read only once it has been left alone for ``SETTLE_S`` (50 ms, by its mtime: at once for a file
older than that; a freshly written one waits out the rest), and refused "is being written" if it keeps
changing for ``SETTLE_MAX_S``. A writer paused for longer than that in the middle of a rewrite can still hand
a load a mix of its old and new bytes: to replace an adapter that is being served, write the new files
elsewhere and rename them into place (``save_peft_adapter`` does), which every read survives.

A :class:`FileStamp` is (device, inode, size, mtime_ns, ctime_ns): another file (a replace by rename), another
size, another mtime, or another ctime, which every write and every metadata change (``touch -d`` setting mtime
back included) moves and which a user cannot set. (Kernels before Linux 6.13, without multigrain timestamps,
stamp files with the clock tick, 1-10 ms, so a write in the tick of an earlier one leaves the stamp as it
was; a file read only after it settled is older than a tick, so any write gives it a newer stamp.)

Odd paths get messages that say what is there: nothing, a dangling symlink, a symlink loop, a directory,
a FIFO or device (opened without blocking, then refused), a path component that is not a directory.
"""

from __future__ import annotations

import datetime
import errno
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from multilora.runtime.adapters.spec import CONFIG_NAME, AdapterError

SAFETENSORS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"


@dataclass(frozen=True)
class FileStamp:
    """One of an adapter's files as the filesystem describes it: which file (``dev``, ``ino``) and which version
    of it (``size`` in bytes, ``mtime_ns``, ``ctime_ns``). ``ino`` is None when nothing readable was there."""

    name: str
    dev: int | None = None
    ino: int | None = None
    size: int | None = None
    mtime_ns: int | None = None
    ctime_ns: int | None = None

    @classmethod
    def of(cls, name: str, st: os.stat_result) -> FileStamp:
        return cls(name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def change_to(self, now: FileStamp) -> str:
        """How ``now`` differs from this stamp, in words (e.g. ``"size 120 -> 96 bytes, mtime ... -> ..."``)."""
        if now.name != self.name:
            return f"the weights would now be read from {now.name} instead of {self.name}"
        if now.ino is None or self.ino is None:
            return f"{self.name} {'vanished (or can no longer be opened)' if now.ino is None else 'appeared'}"
        parts = []
        if (now.dev, now.ino) != (self.dev, self.ino):
            parts.append(f"replaced by another file (inode {self.ino} -> {now.ino})")
        if now.size != self.size:
            parts.append(f"size {self.size} -> {now.size} bytes")
        if now.mtime_ns != self.mtime_ns:
            parts.append(f"mtime {_when(self.mtime_ns)} -> {_when(now.mtime_ns)}")
        if now.ctime_ns != self.ctime_ns and not parts:
            parts.append(f"rewritten with the same size and mtime (ctime {_when(self.ctime_ns)} -> "
                         f"{_when(now.ctime_ns)})")
        return f"{self.name}: " + ", ".join(parts or ["unchanged"])


def _when(ns: int | None) -> str:
    if ns is None:
        return "?"
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f") + "Z"


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _kind(st: os.stat_result) -> str:
    """What a non-regular entry is, for messages."""
    return next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")


def _os_problem(path: Path, e: OSError, missing: str) -> str:
    """Why ``path`` cannot be opened or stat-ed, in words; ``missing`` when nothing is there."""
    if e.errno == errno.ENOENT:
        try:
            return f"a symlink to {os.readlink(path)!r}, which does not exist"
        except OSError:  # not a symlink (or no longer there)
            return missing
    if e.errno == errno.ELOOP:
        return "a symlink loop (too many levels of symbolic links)"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if e.errno == errno.ENOTDIR:
        return "a component of the path is not a directory"
    return f"cannot be opened: {e.strerror or e}"


def check_directory(root: Path) -> None:
    """Raise AdapterError unless ``root`` is (a symlink to) a directory, saying what it is otherwise."""
    try:
        st = os.stat(root)
    except OSError as e:
        raise AdapterError(f"{root}: {_os_problem(root, e, 'adapter directory does not exist')}", path=root) from e
    if not stat.S_ISDIR(st.st_mode):
        got = "a file" if stat.S_ISREG(st.st_mode) else _kind(st)
        raise AdapterError(
            f"{root}: expected a directory holding {CONFIG_NAME} and {SAFETENSORS_NAME}, got {got}", path=root
        )


def weights_path(root: Path) -> Path | None:
    """The weight file an adapter directory gives: ``adapter_model.safetensors`` if there is an entry of that
    name (whatever it is: opening it says what is wrong), else ``adapter_model.bin`` likewise, else None."""
    for name in (SAFETENSORS_NAME, PICKLE_NAME):
        if os.path.lexists(root / name):
            return root / name
    return None


def stamp_of(path: Path) -> FileStamp:
    """``path``'s stamp (following symlinks); one with ``ino`` None if it cannot be stat-ed or is no file."""
    try:
        st = os.stat(path)
    except OSError:
        return FileStamp(path.name)
    return FileStamp.of(path.name, st) if stat.S_ISREG(st.st_mode) else FileStamp(path.name)


def files_fingerprint(root: str | os.PathLike) -> tuple[FileStamp, FileStamp]:
    """The stamps of the two files an adapter is read from: ``adapter_config.json`` and its weight file
    (:func:`weights_path`; ``adapter_model.safetensors`` when there is neither). Other files of the directory
    do not count. Equal to ``LoRAAdapter.files`` of a load while neither file changed."""
    root = Path(root)
    return stamp_of(root / CONFIG_NAME), stamp_of(weights_path(root) or root / SAFETENSORS_NAME)


#: how long a file must have been left alone (by its mtime) before it is read, and how long to wait for that
SETTLE_S = 0.05
SETTLE_MAX_S = 1.0

#: never block opening a FIFO; binary mode and no inheritance where the platform has the flags
_OPEN_FLAGS = sum(getattr(os, flag, 0) for flag in ("O_NONBLOCK", "O_CLOEXEC", "O_BINARY"))


#: buffers per ``preadv`` call (POSIX guarantees at least 16; Linux allows 1024)
_IOV_MAX = max(16, min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in getattr(
    os, "sysconf_names", {}) else 16))


def _read_at(fd: int, buf: memoryview, pos: int) -> int:
    """One read of up to ``len(buf)`` bytes at byte ``pos`` into ``buf``: how many were read (0: end of file)."""
    if hasattr(os, "preadv"):  # Linux, BSDs: straight into buf
        return os.preadv(fd, [buf], pos)
    if hasattr(os, "pread"):
        data = os.pread(fd, len(buf), pos)
    else:  # Windows: every OpenFile has its own descriptor, so seeking it is safe
        os.lseek(fd, pos, os.SEEK_SET)
        data = os.read(fd, len(buf))
    buf[: len(data)] = data
    return len(data)


class OpenFile:
    """A regular file open for plain reads, with its stamp taken at open.

    ``read_into`` / ``read`` read at an offset and fail on a short read; ``check_unchanged`` compares the stamp
    now with the one taken at open. Raises AdapterError naming the path: nothing there (``missing`` says what),
    a dangling symlink, a symlink loop, a directory / FIFO / device (never blocks on one), no permission."""

    def __init__(self, path: Path, missing: str = "does not exist") -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
        except OSError as e:
            raise AdapterError(f"{path}: {_os_problem(path, e, missing)}", path=path) from e
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(self._fd)
            raise AdapterError(f"{path}: expected a file, got {_kind(st)}", path=path)
        self.stamp = FileStamp.of(path.name, st)
        try:
            self._settle()
        except BaseException:
            self.close()
            raise

    def _settle(self) -> None:
        """Return once the file has been quiet for ``SETTLE_S``: at once if its mtime is older than that, else
        after waiting out the rest (a file modified that recently may be mid-rewrite by a writer that paused
        between writes: its stamp would not move while it is read, the bytes being half old, half new).
        Raises AdapterError "is being written" if it keeps changing for ``SETTLE_MAX_S``."""
        changes, deadline = 0, time.monotonic() + SETTLE_MAX_S
        while True:
            age = time.time_ns() - (self.stamp.mtime_ns or 0)
            if age >= SETTLE_S * 1e9:
                return
            if time.monotonic() > deadline:
                raise AdapterError(f"{self.path}: is being written (it changed {changes} times in the last "
                                   f"{SETTLE_MAX_S:g} s): load it again once it is complete", path=self.path)
            # (a file stamped in the future, by a skewed clock of a network filesystem: one full wait)
            time.sleep(SETTLE_S - age / 1e9 if age >= 0 else SETTLE_S)
            now = FileStamp.of(self.path.name, os.fstat(self._fd))
            if now == self.stamp:
                return
            self.stamp, changes = now, changes + 1

    @property
    def size(self) -> int:
        """The file's size in bytes when it was opened."""
        assert self.stamp.size is not None
        return self.stamp.size

    def read_into(self, buf: memoryview, offset: int) -> None:
        """Fill ``buf`` (a writable byte buffer) with the file's bytes from ``offset``. Raises AdapterError (see
        :meth:`fault`) if the file ends first or a read fails."""
        want, pos = len(buf), offset
        while len(buf):
            try:
                n = _read_at(self._fd, buf, pos)
            except OSError as e:
                raise self.fault(f"a read at byte {pos} failed: {e.strerror or e}") from e
            if n == 0:
                raise self.fault(f"a read of {want} bytes at byte {offset} came up {len(buf)} bytes short "
                                 f"(the file was {self.size} bytes when opened)")
            buf, pos = buf[n:], pos + n

    def read_scatter(self, bufs: list[memoryview], offset: int) -> None:
        """Fill ``bufs`` in turn with the file's consecutive bytes from ``offset``, in as few system calls as the
        platform allows (``preadv`` takes up to ``IOV_MAX`` buffers per call, the GIL released for all of them;
        elsewhere one :meth:`read_into` per buffer). Raises AdapterError as :meth:`read_into`."""
        if not hasattr(os, "preadv"):
            for b in bufs:
                self.read_into(b, offset)
                offset += len(b)
            return
        i, pos = 0, offset
        bufs = [b for b in bufs if len(b)]
        while i < len(bufs):
            group = bufs[i : i + _IOV_MAX]
            want = sum(len(b) for b in group)
            try:
                n = os.preadv(self._fd, group, pos)
            except OSError as e:
                raise self.fault(f"a read at byte {pos} failed: {e.strerror or e}") from e
            if n == 0:
                raise self.fault(f"a read of {want} bytes at byte {pos} came up {want} bytes short "
                                 f"(the file was {self.size} bytes when opened)")
            pos += n
            while n and n >= len(bufs[i]):  # the buffers filled whole
                n -= len(bufs[i])
                i += 1
            if n:  # a short read ended inside bufs[i]: the rest of it next
                bufs[i] = bufs[i][n:]

    def read_cached(self, bufs: list[memoryview], offset: int) -> int | None:
        """Fill ``bufs`` in turn from ``offset`` with what the page cache already holds, without waiting for the
        disk: one ``preadv2(..., RWF_NOWAIT)`` of at most ``IOV_MAX`` buffers (Linux 4.14+). Returns the bytes read
        (all of ``bufs`` when they were all cached; fewer, possibly 0, when the read reached bytes the disk must
        supply), or None where the platform or file system cannot tell (no ``RWF_NOWAIT``, or the call is
        refused): the caller then reads the normal way. Raises AdapterError as :meth:`read_into` on another
        failure."""
        flag = getattr(os, "RWF_NOWAIT", None)
        bufs = [b for b in bufs if len(b)][:_IOV_MAX]
        if flag is None or not hasattr(os, "preadv") or not bufs:
            return None
        try:
            return os.preadv(self._fd, bufs, offset, flag)
        except BlockingIOError:  # EAGAIN: the first byte is not in the page cache
            return 0
        except NotImplementedError:  # a Python built without preadv2: no flags
            return None
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                return None
            raise self.fault(f"a read at byte {offset} failed: {e.strerror or e}") from e

    def will_need(self) -> bool:
        """Ask the OS to start reading the whole file into its page cache now (``posix_fadvise(POSIX_FADV_WILLNEED)``:
        the reads are queued, not waited for, though queueing those of a large file can itself take a while), so
        that the reads that follow find the bytes on their way or there, the disk's queue kept full instead of one
        read's readahead at a time. Advice only: True if given;
        False where the platform has no ``posix_fadvise`` or the file system refuses it (the reads work the same)."""
        if not hasattr(os, "posix_fadvise"):
            return False
        try:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            return False
        return True

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes from ``offset`` (as :meth:`read_into`)."""
        buf = bytearray(n)
        self.read_into(memoryview(buf), offset)
        return bytes(buf)

    def changed(self) -> str | None:
        """How the file changed since it was opened (in words), or None."""
        now = FileStamp.of(self.path.name, os.fstat(self._fd))
        return None if now == self.stamp else self.stamp.change_to(now)

    def fault(self, what: str, key: str | None = None) -> AdapterError:
        """The error for a read or parse that failed because of ``what`` (about tensor ``key``): "changed while it
        was being read" when the stamp moved since open (``what`` is then a consequence), else ``what``."""
        how = self.changed()
        return AdapterError(f"{self.path}: {what}" if how is None else _changed(self.path, f"{how}; {what}"),
                            path=self.path, key=key)

    def check_unchanged(self) -> None:
        """Raise AdapterError "changed while it was being read" if the stamp moved since open."""
        how = self.changed()
        if how is not None:
            raise AdapterError(_changed(self.path, how), path=self.path)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> OpenFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _changed(path: Path, how: str) -> str:
    return (f"{path}: changed while it was being read ({how}): if it is being written, load it again once it "
            "is complete")


def read_whole(path: Path, missing: str) -> tuple[bytes, FileStamp]:
    """A small file's bytes, read and checked unchanged: ``(data, stamp)``. Raises AdapterError (see OpenFile)."""
    with OpenFile(path, missing) as f:
        data = f.read(0, f.size)
        f.check_unchanged()
        return data, f.stamp
