"""Where a checkpoint lives: a local directory, or a prefix of an object store named by a URL
(`s3://bucket/prefix` on S3 and S3-compatible servers, `gs://bucket/prefix` on Google Cloud
Storage). The core reads and writes both; Python code passes the location string through and never
treats a URL as a filesystem path. Object-store credentials and endpoint come from the standard
variables (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`,
`AWS_ALLOW_HTTP=true`; `GOOGLE_*`)."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import InvalidArgumentError

__all__ = ["URL_SCHEMES", "checkpoint_location", "is_url", "local_dir"]

URL_SCHEMES = ("s3", "s3a", "gs")


def is_url(location: str | os.PathLike[str]) -> bool:
    """True if `location` is a URL (`scheme://...`) rather than a local path."""
    return isinstance(location, str) and "://" in location


def local_dir(path: str | os.PathLike[str], what: str) -> Path:
    """`path` as a local directory path; `InvalidArgumentError` for a URL, where `what` (a
    Hugging Face or DCP directory, an export's output) is read or written through the local
    filesystem only (`Path("s3://b/x")` is the local path `s3:/b/x`)."""
    try:
        s = os.fspath(path)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be a str or os.PathLike path, not {path!r}") from None
    if is_url(s):
        raise InvalidArgumentError(f"{s}: {what} must be a local directory, not a URL (only olmo-chunks "
                                   "checkpoints live in object stores)")
    return Path(s)


def checkpoint_location(path: str | os.PathLike[str]) -> str:
    """`path` as the location string the core takes: an object-store URL of a supported scheme
    with its empty segments dropped (`s3://b//x/` is `s3://b/x`, the keys the core uses for
    both, so ranks passing either agree), or a local path."""
    try:
        s = os.fspath(path)
    except TypeError:
        s = None
    if not isinstance(s, str) or not s:
        raise InvalidArgumentError(f"a checkpoint path must be a non-empty str or os.PathLike, not {path!r}")
    if not is_url(s):
        return s
    scheme, rest = s.split("://", 1)
    if scheme not in URL_SCHEMES:
        raise InvalidArgumentError(
            f"{s}: unsupported URL scheme {scheme!r} (supported: "
            + ", ".join(f"{x}://bucket/prefix" for x in URL_SCHEMES) + ", or a local path)"
        )
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise InvalidArgumentError(f"{s}: no bucket name")
    keys = "/".join(part for part in prefix.split("/") if part)
    return f"{scheme}://{bucket}/{keys}" if keys else f"{scheme}://{bucket}"
