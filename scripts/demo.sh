#!/usr/bin/env bash
# Set up (or reuse) the environment, build, and run the main job: save on one layout, load
# resharded on another, verify bit-exact, print throughput. Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
python examples/reshard_demo.py "$@"
