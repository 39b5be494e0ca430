#!/usr/bin/env bash
# Create (or reuse) the project virtual env and build the native extension into it.
# Source this file: it exports VENV and puts it first on PATH.
# The env lives outside the clone, keyed by a hash of requirements-dev.txt,
# requirements-integrations.txt and requirements-lock.txt (exact pins, used as pip constraints), so
# repeated runs and CI reuse the ~3 GB torch install while the requirements and pins stay the same,
# and a change of pins makes a new env.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HASH="$( (cat "$ROOT/requirements-dev.txt" "$ROOT/requirements-integrations.txt" "$ROOT/requirements-lock.txt"; python3 -c 'import sys; print(sys.version_info[:2])') | sha256sum | cut -c1-16)"
VENV="${OLMO_CHUNKS_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/olmo-chunks/venv-$HASH}"
if [ ! -f "$VENV/.complete" ]; then
    mkdir -p "$(dirname "$VENV")"
    # One creator at a time (flock where available): a concurrent run waits, then reuses the env.
    (
        if command -v flock >/dev/null; then flock 9; fi
        if [ ! -f "$VENV/.complete" ]; then
            echo "[setup] creating $VENV (first run downloads torch, ~3 GB)" >&2
            rm -rf "$VENV"
            python3 -m venv "$VENV"
            "$VENV/bin/python" -m pip install -q --upgrade pip -c "$ROOT/requirements-lock.txt"
            "$VENV/bin/python" -m pip install -q -r "$ROOT/requirements-dev.txt" -c "$ROOT/requirements-lock.txt"
            # OLMo-core declares torch<2.14: installed without dependency resolution, on the lock's torch.
            "$VENV/bin/python" -m pip install -q --no-deps -r "$ROOT/requirements-integrations.txt" -c "$ROOT/requirements-lock.txt"
            touch "$VENV/.complete"
        fi
    ) 9>"$VENV.lock"
else
    echo "[setup] reusing $VENV" >&2
fi
export VENV
export PATH="$VENV/bin:$PATH"
# Cargo's build outputs outside the clone too, keyed by Cargo.lock and the toolchain: a fresh clone
# compiles this workspace's two crates, not their ~200 dependencies again (~3 min on 2 cores).
if [ -z "${CARGO_TARGET_DIR:-}" ]; then
    CARGO_TARGET_DIR="$(dirname "$VENV")/target-$( (cat "$ROOT/Cargo.lock"; rustc -vV) | sha256sum | cut -c1-16)"
    export CARGO_TARGET_DIR
fi
export VIRTUAL_ENV="$VENV"
# The pyo3 environment maturin builds the extension with, for every cargo command (clippy checks the
# extension crate too): with another one, each invalidates the other's pyo3 build, and the next
# maturin build recompiles pyo3 and relinks the extension (~50 s on 2 cores).
export PYO3_PYTHON="$VENV/bin/python" PYTHON_SYS_EXECUTABLE="$VENV/bin/python" PYO3_BUILD_EXTENSION_MODULE=1
PYO3_ENVIRONMENT_SIGNATURE="$("$VENV/bin/python" -c 'import platform, sys; v = sys.version_info; print(f"{platform.python_implementation().lower()}-{v[0]}.{v[1]}-64bit")')"
export PYO3_ENVIRONMENT_SIGNATURE
if [ "${OLMO_CHUNKS_SKIP_BUILD:-0}" != 1 ]; then
    echo "[setup] building the native extension (maturin develop --release)" >&2
    # PIP_QUIET: maturin -q still let pip list every requirement already satisfied (some 40 lines).
    (cd "$ROOT" && PIP_QUIET=1 maturin develop --release -q >&2)
fi
