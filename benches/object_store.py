"""Save and resharded-load throughput on a real S3-compatible server, against the same bytes moved
with object_store alone (the roofline).

    python benches/object_store.py --size-gb 0.5 --reps 2 --json out.json

moto, which the protocol tests use, answers a ranged GET by copying the whole object, so it counts
requests but not bandwidth. This script runs `s3s-fs` (crates.io: an S3 server over a local
directory, whose ranged GETs read just that range of a file), building it with `cargo install`
the first time into `~/.cache/olmo-chunks/tools/` (about 10 minutes on 2 cores; kept outside the
clone and reused), starts it on a free port of 127.0.0.1 over a fresh directory (`--dir`, default
the temp dir), and runs `olmo-chunks bench --path s3://bench/run` against it. Each pair then has,
besides the local rows, `@url` rows: our save and load through both doors, and the roofline, each
rank PUTting its share of the bytes as one object (8 MiB parts) and GETting its load share in
8 MiB ranged GETs, as many in flight as a load has I/O workers. "of roof" of an `@url` row is
against that roofline; requests are per rank.

Server and clients share this machine's cores, so the absolute GB/s say little of a real store;
the ratios say how close our requests come to what the client library itself can move.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

S3S_FS = "0.14.1"  # the newest s3s-fs that builds with this toolchain (0.17 needs rustc 1.96)
TOOLS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "olmo-chunks" / "tools"

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.s3server import free_port, stop, wait_listening  # noqa: E402


def s3s_fs() -> Path:
    """The s3s-fs binary, built on first use."""
    root = TOOLS / f"s3s-fs-{S3S_FS}"
    binary = root / "bin" / "s3s-fs"
    if not binary.exists():
        print(f"building s3s-fs {S3S_FS} into {root} (once)", file=sys.stderr)
        subprocess.run(["cargo", "install", f"s3s-fs@{S3S_FS}", "--locked", "--features", "binary",
                        "--root", str(root)], check=True)
    return binary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=0.5, help="state size in GiB (default 0.5)")
    p.add_argument("--reps", type=int, default=2, help="repetitions; the best is reported (default 2)")
    p.add_argument("--dir", default=None, help="where the server and the local rows keep their files")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="olmo-chunks-s3-", dir=args.dir))
    (base / "server" / "bench").mkdir(parents=True)  # the bucket is a directory of the server's root
    port = free_port()
    server = subprocess.Popen([str(s3s_fs()), "--host", "127.0.0.1", "--port", str(port), "--access-key", "testing",
                               "--secret-key", "testing", str(base / "server")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_listening(port, server)
        env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
        cmd = [sys.executable, "-m", "olmo_chunks", "bench", "--size-gb", str(args.size_gb), "--reps",
               str(args.reps), "--dir", str(base / "local"), "--path", "s3://bench/run"]
        if args.json:
            cmd += ["--json", args.json]
        (base / "local").mkdir()
        print(f"s3s-fs {S3S_FS} on 127.0.0.1:{port}", flush=True)
        return subprocess.run(cmd, env=env).returncode
    finally:
        stop(server)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
