"""Whether a package in the shared directory may be loaded: the trust boundary of the package
store (package_store.py). A package's library runs its code in the process that loads it, and
its constants answer for the model, so a package is loaded only where it can be told that
this deployment wrote it, one of two ways:

- **Owner only** (the default): the packages' directory and the file belong to this process's
  user (or root) and no one else may write them, and the file has no other name: the checks
  ssh applies to its key files (``StrictModes``). Any other writer is refused.
- **Secret** (``SHAPECACHE_SHARED_SECRET_FILE``, where the operator shares the directory with
  other users on purpose): a package is loaded only with a seal made under the deployment's
  secret (HMAC-SHA256), whoever owns the file; the directory's and file's owners are not
  checked. The secret's file must be its owner's alone to read.

Either way each package carries a seal over every byte of the file (``seal``), an HMAC under
the secret or else a SHA-256 digest, so a package changed after it was published (its
weights zeroed, a member swapped, a torn copy) is refused. The seal is the archive's comment,
the last bytes of the file, so what the seal covers is the whole file as any zip reader sees
it: no member or directory can be added outside it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat

SECRET_FILE_VARIABLE = "SHAPECACHE_SHARED_SECRET_FILE"
MIN_SECRET_BYTES = 16

_END_RECORD = b"PK\x05\x06"  # the zip end-of-central-directory record's signature
_END_RECORD_BYTES = 22  # its size, less its comment (the last field: the comment's length)
_PREFIX = b"shapecache seal 1 "
_HMAC, _DIGEST = b"hmac", b"sha2"  # the seal's kinds, then a space and 64 hexadecimal digits
SEAL_BYTES = len(_PREFIX) + 4 + 1 + 64


class SecretUnusable(Exception):
    """The secret's file is set but cannot serve as one (the message says why)."""


def secret() -> bytes | None:
    """The deployment's secret: the bytes of the file ``SHAPECACHE_SHARED_SECRET_FILE`` names,
    stripped of surrounding white space; None where the variable is not set. Raises
    SecretUnusable where the file cannot be read, is shorter than 16 bytes, or may be read by
    users other than its owner (a secret others can read proves nothing)."""
    path = os.environ.get(SECRET_FILE_VARIABLE)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            status = os.fstat(f.fileno())
            value = f.read(1 << 16).strip()
    except OSError as error:
        raise SecretUnusable(f"{SECRET_FILE_VARIABLE}={path!r} cannot be read ({error})") from error
    if status.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretUnusable(f"{SECRET_FILE_VARIABLE}={path!r} may be read or written by users other than its "
                             f"owner (mode {stat.S_IMODE(status.st_mode):o}); expected mode 600 or 400")
    if len(value) < MIN_SECRET_BYTES:
        raise SecretUnusable(f"{SECRET_FILE_VARIABLE}={path!r} holds {len(value)} bytes; expected at least "
                             f"{MIN_SECRET_BYTES}")
    return value


def untrusted_directory(status: os.stat_result, key: bytes | None) -> str | None:
    """Why packages in the directory with `status` may be another user's; None where only this
    process's user (or root) can write there, or where packages are proven by `key` instead."""
    if key is not None:
        return None
    if status.st_uid not in (os.geteuid(), 0):
        return (f"the directory belongs to user id {status.st_uid}, not to this process's {os.geteuid()} (set "
                f"{SECRET_FILE_VARIABLE} to share packages between users)")
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"users other than its owner may write the directory (mode {stat.S_IMODE(status.st_mode):o}; set "
                f"{SECRET_FILE_VARIABLE} to share packages between users)")
    return None


def untrusted_file(status: os.stat_result, key: bytes | None) -> str | None:
    """Why a package file with `status` may hold what another user wrote, or be another name of
    a package of this user's; None where only this process's user (or root) wrote it, or, with
    a `key`, where it is a regular file (its seal proves the rest)."""
    if not stat.S_ISREG(status.st_mode):
        return "it is not a regular file"
    if key is not None:
        return None
    if status.st_uid != os.geteuid():
        return f"it belongs to user id {status.st_uid}, not to this process's {os.geteuid()}"
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"users other than its owner may write it (mode {stat.S_IMODE(status.st_mode):o})"
    if status.st_nlink != 1:
        return f"it has {status.st_nlink} names (hard links)"
    return None


def seal(file, key: bytes | None) -> None:
    """Seals the zip archive in `file` (open for reading and writing, holding a zip archive
    without a comment, as torch writes packages): sets its comment to the seal, an HMAC under
    `key` (a digest where None) of every byte before it. Raises ValueError where the file is no
    such archive."""
    size = file.seek(0, os.SEEK_END)
    if size < _END_RECORD_BYTES:
        raise ValueError("the package is not a zip archive")
    file.seek(size - _END_RECORD_BYTES)
    end = file.read(_END_RECORD_BYTES)
    if end[:4] != _END_RECORD or end[-2:] != b"\0\0":
        raise ValueError("the package is not a zip archive without a comment")
    file.seek(size - 2)
    file.write(SEAL_BYTES.to_bytes(2, "little"))
    file.flush()
    mac = _mac(file, size, key)
    file.seek(size)
    file.write(_PREFIX + (_DIGEST if key is None else _HMAC) + b" " + mac.encode())
    file.flush()


def unsealed(file, key: bytes | None) -> str | None:
    """Why the package in `file` (open for reading) is not as its publisher sealed it; None
    where its seal is there, of the kind `key` asks for, and matches every byte before it."""
    size = file.seek(0, os.SEEK_END)
    if size < _END_RECORD_BYTES + SEAL_BYTES:
        return "it carries no seal"
    file.seek(size - _END_RECORD_BYTES - SEAL_BYTES)
    tail = file.read(_END_RECORD_BYTES + SEAL_BYTES)
    end, found = tail[:_END_RECORD_BYTES], tail[_END_RECORD_BYTES:]
    if end[:4] != _END_RECORD or end[-2:] != SEAL_BYTES.to_bytes(2, "little") or not found.startswith(_PREFIX):
        return "it carries no seal"
    kind, mac = found[len(_PREFIX):len(_PREFIX) + 4], found[-64:]
    if key is not None and kind != _HMAC:
        return f"it is not sealed with the deployment's secret ({SECRET_FILE_VARIABLE})"
    if key is None and kind != _DIGEST:
        return f"it is sealed with a secret this process is not given ({SECRET_FILE_VARIABLE} is not set)"
    if not hmac.compare_digest(mac, _mac(file, size - SEAL_BYTES, key).encode()):
        return "its bytes are not those it was sealed with (changed or damaged since it was published)"
    return None


def _mac(file, length: int, key: bytes | None) -> str:
    """The HMAC-SHA256 under `key` (SHA-256 where None) of the first `length` bytes of `file`."""
    digest = hashlib.sha256() if key is None else hmac.new(key, digestmod=hashlib.sha256)
    file.seek(0)
    left = length
    while left > 0:
        chunk = file.read(min(left, 1 << 20))
        if not chunk:
            raise ValueError("the package ended early")
        digest.update(chunk)
        left -= len(chunk)
    return digest.hexdigest()
