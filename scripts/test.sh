#!/usr/bin/env bash
# Set up (or reuse) the environment, build, and run every test: Rust (fmt, clippy, unit and
# property tests), the release wheel installed into a fresh venv, and Python (pytest over real
# multi-process gloo groups).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
echo "[test +${SECONDS}s] cargo fmt / clippy" >&2
cargo fmt --all -- --check
cargo clippy --release --all-targets -q -- -D warnings
echo "[test +${SECONDS}s] cargo test" >&2
cargo test --release -q -p olmo-chunks-core
echo "[test +${SECONDS}s] ruff" >&2
ruff check python tests benches examples
# mypy's cache beside the venv (it checks each cached module against its source's hash): a fresh
# clone does not analyse torch again (~50 s on 2 cores).
export MYPY_CACHE_DIR="$VENV.mypy_cache"
echo "[test +${SECONDS}s] stubtest (python/olmo_chunks/_core.pyi against the built extension)" >&2
python -m mypy.stubtest olmo_chunks._core
echo "[test +${SECONDS}s] mypy (the package)" >&2
python -m mypy
echo "[test +${SECONDS}s] the wheel as users install it (scripts/wheel_smoke.sh)" >&2
bash scripts/wheel_smoke.sh
echo "[test +${SECONDS}s] pytest" >&2
python -m pytest -q -p no:cacheprovider "$@"
