#!/usr/bin/env bash
# The core of the suite (layout and resharding property tests, both doors, async save, read-once, trainer
# state) on each torch version given, default: the oldest pyproject.toml claims and the lock's.
# Each version gets its own venv outside the clone, keyed like the main one (a hash of the version,
# this file and the lock), holding that torch and the test tools only; the release abi3 wheel is
# built once and installed into each (--no-deps), so the tests run on the package as users get it.
# The lock's torch runs in the main venv (scripts/env.sh), where the whole suite also runs.
# Usage: bash scripts/test_torch_versions.sh [VERSION ...]   ("floor" and "locked" name those two)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OLMO_CHUNKS_SKIP_BUILD=1 source scripts/env.sh
CORE_TESTS=(tests/test_layout.py tests/test_reshard.py tests/test_native.py tests/test_dcp.py tests/test_async_save.py
            tests/test_read_once.py tests/test_trainer_state.py tests/test_resume_strict.py)
FLOOR="$(sed -n 's/^dependencies = .*"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)"
LOCKED="$(sed -n 's/^torch==\([^+]*\).*/\1/p' requirements-lock.txt)"
if [ $# -eq 0 ]; then set -- "$FLOOR" "$LOCKED"; fi
VERSIONS=()
for V in "$@"; do
    case "$V" in floor) VERSIONS+=("$FLOOR") ;; locked) VERSIONS+=("$LOCKED") ;; *) VERSIONS+=("$V") ;; esac
done
set -- "${VERSIONS[@]}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/olmo-chunks-torch.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
echo "[torch] maturin build --release (abi3)" >&2
maturin build --release -q -o "$WORK/dist" >&2
WHEEL="$(ls "$WORK"/dist/olmo_chunks-*-abi3-*.whl)"
# The lock's pins for the test tools; torch brings the versions of its own dependencies it needs.
TOOLS=(numpy pytest pytest-timeout hypothesis packaging)
grep -E "^($(IFS='|'; echo "${TOOLS[*]}"))==" requirements-lock.txt > "$WORK/constraints.txt"
status=0
for V in "$@"; do
    if [ "$V" = "$LOCKED" ]; then
        PY="$VENV/bin/python"
        (cd "$ROOT" && maturin develop --release -q >&2)
    else
        HASH="$( (echo "$V"; cat "$ROOT/scripts/test_torch_versions.sh" "$WORK/constraints.txt"; python3 -c 'import sys; print(sys.version_info[:2])') | sha256sum | cut -c1-16)"
        TV="${XDG_CACHE_HOME:-$HOME/.cache}/olmo-chunks/torch-$V-$HASH"
        if [ ! -f "$TV/.complete" ]; then
            echo "[torch $V] creating $TV (downloads torch $V)" >&2
            rm -rf "$TV"
            python3 -m venv "$TV"
            "$TV/bin/python" -m pip install -q "torch==$V" "${TOOLS[@]}" -c "$WORK/constraints.txt"
            touch "$TV/.complete"
        fi
        "$TV/bin/python" -m pip install -q --no-deps --force-reinstall "$WHEEL"
        PY="$TV/bin/python"
    fi
    echo "[torch $V] $("$PY" -c 'import torch; print(torch.__version__)'): ${CORE_TESTS[*]}" >&2
    if "$PY" -m pytest -q -p no:cacheprovider "${CORE_TESTS[@]}"; then
        echo "[torch $V] passed" >&2
    else
        echo "[torch $V] FAILED" >&2
        status=1
    fi
done
exit $status
