"""Make `tests.*` and, until the package is installed, `olmo_chunks` importable here and in workers."""

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# An installed olmo_chunks carries the native module; the bare source tree must not shadow it.
if importlib.util.find_spec("olmo_chunks") is None:
    sys.path.insert(0, str(ROOT / "python"))
# pytest's filterwarnings (pyproject.toml) governs this process only; spawned gloo workers and CLI
# subprocesses, where most DCP and DTensor code runs, get the same rule through their environment.
os.environ.setdefault("PYTHONWARNINGS", "error::DeprecationWarning,error::FutureWarning")


def pytest_sessionfinish(session, exitstatus):
    """Stop the gloo worlds the tests started, if any."""
    world = sys.modules.get("tests.world")
    if world is not None:
        world.shutdown()
