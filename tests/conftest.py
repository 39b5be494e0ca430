"""Make `tests.*` and, until the package is installed, `olmo_chunks` importable here and in workers;
the session's S3-compatible server (`s3`)."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# The tree under test where its native module is built in place (`maturin develop`), here, in
# workers and in subprocesses: the venv that setup shares between clones points at whichever clone
# ran `maturin develop` last, whose code would be tested otherwise. Else an installed olmo_chunks,
# which carries its native module (a bare source tree must not shadow it).
PACKAGE_ROOT = ROOT / "python"
if any((PACKAGE_ROOT / "olmo_chunks").glob("_core*")) or importlib.util.find_spec("olmo_chunks") is None:
    sys.path.insert(0, str(PACKAGE_ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))
# pytest's filterwarnings (pyproject.toml) governs this process only; spawned gloo workers and CLI
# subprocesses, where most DCP and DTensor code runs, get the same rule through their environment.
os.environ.setdefault("PYTHONWARNINGS", "error::DeprecationWarning,error::FutureWarning")


@pytest.fixture(scope="session", autouse=True)
def _warning_rules_hold_in_every_world():
    """After the session's tests: in every persistent gloo world they used, deprecations are still
    errors (no test or library code left a global warning filter behind in a worker)."""
    yield
    world = sys.modules.get("tests.world")
    if world is None:
        return
    broken = {}
    for size in world.sizes():
        rules = world.run(size, world.warning_rules)
        if any(r != world.WARNINGS_RAISE for r in rules):
            broken[size] = rules
    assert not broken, f"warning rules changed in gloo worlds (size: per-rank rules): {broken}"


def pytest_sessionfinish(session, exitstatus):
    """Stop the gloo worlds the tests started, if any."""
    world = sys.modules.get("tests.world")
    if world is not None:
        world.shutdown()


@pytest.fixture(scope="session")
def s3():
    """A real S3-compatible server (moto) on 127.0.0.1 for the session, stopped at its end."""
    from tests.s3server import S3Server

    server = S3Server()
    try:
        yield server
    finally:
        server.close()
