"""Small shared utilities, one home each: canonical JSON, sha256 of text and files, atomic writes."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from core.display import shown


def canonical_json(value: Any) -> str:
    """Deterministic JSON: sorted keys, no whitespace, UTF-8 kept, NaN/inf refused."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class NotRegularFileError(ValueError):
    """A path that is not a regular file of its own (a FIFO, a device, a socket, a directory, a symbolic link, or,
    where one name is required, a hard link)."""


_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISLNK, "a symbolic link"))


def not_regular(st: os.stat_result, single_link: bool = False) -> str | None:
    """Why a file of these stats is not one to read as data (None when it is): not a regular file, or, with
    `single_link`, a file that has other names (a hard link shares the file with a name that may lie anywhere on
    the file system; its content is someone else's)."""
    kind = next((what for test, what in _KINDS if test(st.st_mode)), None)
    if kind is not None or not stat.S_ISREG(st.st_mode):
        return f"{kind or 'not a regular file'}, not a regular file"
    if single_link and st.st_nlink != 1:
        return f"a hard link ({st.st_nlink} names of one file), not a file of its own"
    return None


def open_regular(path: str | Path, single_link: bool = False) -> int:
    """A read-only descriptor of the regular file at `path`, or NotRegularFileError naming it. The type is read
    before the open (a device is never opened: opening one can act), a final symbolic link is not followed
    (O_NOFOLLOW), a FIFO does not block the open (O_NONBLOCK), and the type is read again from the descriptor
    (fstat), which must be the file first looked at: what was checked is what is read."""
    path = Path(path)
    before = os.lstat(path)
    why = not_regular(before, single_link)
    if why is None:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        after = os.fstat(fd)
        why = not_regular(after, single_link) or (
            "replaced while it was opened" if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) else None)
        if why is None:
            return fd
        os.close(fd)
    raise NotRegularFileError(f"{shown(path.name)}: {why}")


def read_regular(path: str | Path, limit: int, single_link: bool = False) -> bytes:
    """The bytes of the regular file at `path` (open_regular), refused (ValueError naming it) past `limit` bytes:
    by its size before anything is read, and by what a read returns (a file that grows while it is read)."""
    with os.fdopen(open_regular(path, single_link), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        raise ValueError(f"{shown(Path(path).name)}: {max(size, len(data))} bytes; expected at most {limit}")
    return data


def write_atomic(path: str | Path, data: bytes | str, mode: int | None = None) -> Path:
    """Write-then-rename in the target's directory, so a killed process never leaves half a file.

    The file gets `mode` when given; else mkstemp's 0600 (owner only). What is shipped to someone else (a bundle,
    a report) passes its mode (`SHIPPED_FILE_MODE`, or the lab's `[nomination] file_mode`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if mode is not None:  # set on the descriptor, before the rename: the file is never seen with another mode
                os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: str | Path, payload: Any, mode: int | None = None) -> Path:
    """Pretty JSON (sorted keys) written atomically (with `mode`, as write_atomic)."""
    return write_atomic(path, json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n", mode)


# ---- modes of what is shipped ---------------------------------------------------------------------------
# A bundle and a report are read by someone else: a server running as another user, a reviewer. mkstemp (write_atomic)
# makes owner-only files, and a umask of 077 owner-only directories, so the modes are set explicitly: files readable
# by everyone (0644), directories searchable by everyone (0755), unless the lab says otherwise in lab.toml
# (`[nomination] file_mode`, recorded in the session's config snapshot: `shipped_file_mode`).
SHIPPED_FILE_MODE = 0o644


def parse_file_mode(text: str) -> int:
    """An octal file mode as lab.toml writes it ("0644", "640"); ValueError saying what is expected otherwise.
    The owner must keep read and write (the lab rewrites the card), and no execute bit is set (bundles are data)."""
    if not isinstance(text, str) or not 3 <= len(text) <= 4 or any(c not in "01234567" for c in text):
        raise ValueError(f"file_mode {str(text)[:20]!r}: expected an octal mode such as \"0644\" or \"0640\"")
    mode = int(text, 8)
    if mode & ~0o666 or mode & 0o600 != 0o600:
        raise ValueError(f"file_mode {text!r}: expected read and write for the owner and no execute, setuid or "
                         "sticky bits (e.g. \"0644\", \"0640\", \"0600\")")
    return mode


def shipped_file_mode(session_config: dict[str, Any] | None) -> int:
    """The mode shipped files get in a session: its recorded lab config's `nomination.file_mode`, else 0644."""
    nomination = ((session_config or {}).get("lab") or {}).get("nomination") or {}
    value = nomination.get("file_mode") if isinstance(nomination, dict) else None
    return SHIPPED_FILE_MODE if value is None else parse_file_mode(value)


def dir_mode(file_mode: int) -> int:
    """A directory's mode for files of `file_mode`: search (x) wherever read is granted (0644 -> 0755)."""
    return file_mode | (file_mode & 0o444) >> 2


def set_tree_modes(root: Path, file_mode: int) -> None:
    """`root` and everything under it: files `file_mode`, directories dir_mode(file_mode). Links are left alone
    (a bundle holds none; check-bundle refuses one leading out)."""
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        os.chmod(path, dir_mode(file_mode) if path.is_dir() else file_mode)


def address_space() -> int:
    """Bytes of virtual address space this process maps now (VmSize, Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmSize line")
