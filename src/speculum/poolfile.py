"""One file format for everything a drafter saves between runs (ANPD's n-gram table, phrase pools).

A file is one JSON header line, then a JSON body::

    {"format": "speculum-ngram-pool", "version": 1, "model_key": "...", <pool settings>,
     "body_bytes": 1234, "body_sha256": "..."}
    {<the pool's own payload>}

- ``model_key`` identifies the tokenizer's vocabulary: a pool is token ids, meaningless under
  another tokenizer, so a file saved for one key is refused under any other.
- Written atomically: a temp file in the same directory, fsync, ``os.replace``. A crash or a full
  disk leaves the previous file as it was, never a half-written one.
- Read defensively: a file that is not of the expected format or version, truncated, padded or
  corrupt (checksum) raises :class:`~speculum.errors.PoolFileError`. No pickle.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from speculum.errors import PoolFileError

__all__ = ["read_pool_file", "write_pool_file"]

_RESERVED = {"format", "version", "model_key", "body_bytes", "body_sha256"}


def write_pool_file(
    path: str | os.PathLike[str],
    *,
    kind: str,
    version: int,
    model_key: str,
    settings: dict[str, Any],
    body: dict[str, Any],
    what: str = "pool",
) -> None:
    """Write ``body`` under a header naming ``kind``/``version``/``model_key`` and ``settings``, atomically."""
    if _RESERVED & settings.keys():
        raise ValueError(f"settings may not use the reserved names {sorted(_RESERVED & settings.keys())}")
    body_bytes = json.dumps(body, separators=(",", ":")).encode("utf-8")
    header = {
        "format": kind,
        "version": version,
        "model_key": model_key,
        **settings,
        "body_bytes": len(body_bytes),
        "body_sha256": hashlib.sha256(body_bytes).hexdigest(),
    }
    blob = json.dumps(header, sort_keys=True).encode("utf-8") + b"\n" + body_bytes
    write_atomic(path, blob, what=f"{what} file", error=PoolFileError)


def write_atomic(path: str | os.PathLike[str], data: bytes, *, what: str = "file", error=OSError) -> None:
    """Write ``data`` to ``path`` all or nothing: a temp file in the same directory, fsync, ``os.replace``.
    An existing file is untouched when anything fails (raised as ``error`` with one clear message)."""
    path = Path(path)
    tmp_name = None
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_name, 0o666 & ~umask)  # mkstemp makes it 0600; a saved file gets the usual mode
        os.replace(tmp_name, path)
        tmp_name = None
    except OSError as exc:
        raise error(f"cannot write {what} {str(path)!r}: {exc}") from exc
    finally:
        if tmp_name is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)


def read_pool_file(
    path: str | os.PathLike[str], *, kind: str, version: int, model_key: str, what: str = "pool"
) -> tuple[dict[str, Any], Any]:
    """The header and decoded body of a file written by :func:`write_pool_file`; PoolFileError otherwise."""
    where = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise PoolFileError(f"cannot read {what} file {where!r}: {exc}") from exc
    newline = raw.find(b"\n")
    header = None
    if newline > 0:
        try:
            header = json.loads(raw[:newline].decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            header = None
    if not isinstance(header, dict) or header.get("format") != kind:
        raise PoolFileError(f"{where!r} is not a speculum {what} file")
    if header.get("version") != version:
        raise PoolFileError(
            f"{where!r} has {what} format version {header.get('version')!r}; this speculum reads version {version}"
        )
    if header.get("model_key") != model_key:
        raise PoolFileError(
            f"{where!r} was built for model_key {header.get('model_key')!r}, "
            f"not {model_key!r} (another tokenizer/vocabulary): refusing to use it"
        )
    body = raw[newline + 1 :]
    if len(body) != header.get("body_bytes"):
        raise PoolFileError(
            f"{where!r} is truncated or padded: body has {len(body)} bytes, header says {header.get('body_bytes')!r}"
        )
    if hashlib.sha256(body).hexdigest() != header.get("body_sha256"):
        raise PoolFileError(f"{where!r} is corrupt: checksum mismatch")
    try:
        payload = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise PoolFileError(f"{where!r} is corrupt: {exc}") from exc
    return header, payload
