#!/usr/bin/env bash
# The wheel as users install it: build the release abi3 wheel, install it with --no-deps into a
# fresh venv that holds only the runtime dependencies (torch, numpy and what they need), and run
# tests/wheel_smoke.py there, outside the source tree: the CLI without torch, `olmo-chunks
# inspect` / `verify` from the installed console script, a 2-rank gloo save and a resharded load.
#
# The runtime dependencies are not downloaded again: the fresh venv links the distributions of the
# dependency closure of the wheel's `Requires-Dist` from the project venv (scripts/env.sh), so it
# sees torch and numpy but not pytest, maturin, the frameworks or the tree's own olmo_chunks; `pip
# check` then proves the wheel's declared requirements are met by exactly those.
# Usage: bash scripts/wheel_smoke.sh   (sources scripts/env.sh itself unless VENV is set)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ -z "${VENV:-}" ]; then
    OLMO_CHUNKS_SKIP_BUILD=1 source scripts/env.sh
fi
WORK="$(mktemp -d "${TMPDIR:-/tmp}/olmo-chunks-wheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
echo "[wheel] maturin build --release (abi3)" >&2
maturin build --release -q -o "$WORK/dist" >&2
WHEEL="$(ls "$WORK"/dist/olmo_chunks-*-abi3-*.whl)"
echo "[wheel] $(basename "$WHEEL"): fresh venv with the runtime dependencies only" >&2
python3 -m venv "$WORK/venv"
"$VENV/bin/python" "$ROOT/tests/wheel_smoke.py" link-runtime "$WHEEL" \
    "$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$WORK/venv/bin/python" -m pip install -q --no-deps --no-index "$WHEEL"
"$WORK/venv/bin/python" -m pip check
cd "$WORK"  # nothing of the source tree on the path
"$WORK/venv/bin/python" "$ROOT/tests/wheel_smoke.py" run "$WORK/venv/bin/olmo-chunks" "$WORK/ckpt"
