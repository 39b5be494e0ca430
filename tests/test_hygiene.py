"""Test hygiene: deprecations are errors in the test process, in the gloo workers and in CLI
subprocesses (not hidden), and every development requirement is pinned exactly in
requirements-lock.txt, which scripts/env.sh installs as constraints and hashes into the venv name."""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests import world

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("category", [DeprecationWarning, FutureWarning])
def test_deprecations_are_errors_in_the_test_process(category):
    with pytest.raises(category):
        warnings.warn("olmo-chunks hygiene probe", category, stacklevel=1)


def test_deprecations_are_errors_in_gloo_workers():
    # Every world the session used is probed again at its end (tests/conftest.py).
    assert world.run(2, world.warning_rules) == [world.WARNINGS_RAISE] * 2


def test_the_package_sets_no_global_warning_filter():
    pkg = ROOT / "python" / "olmo_chunks"
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in sorted(pkg.rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"warnings\.(filterwarnings|simplefilter)\(", line)]
    assert offenders == []


def test_no_module_imports_another_modules_private_names():
    # One save session serves every door (olmo_chunks/session.py): no door reaches into another's
    # private helpers. Private modules (`_core`, `_dist`) are fine; private names inside them are not.
    import ast

    pkg = ROOT / "python" / "olmo_chunks"
    modules = {p.stem for p in pkg.rglob("*.py")} | {"_core"}
    offenders = []
    for path in sorted(pkg.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("olmo_chunks")):
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno}: {a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__") and a.name not in modules]
    assert offenders == []


def test_deprecations_are_errors_in_subprocesses():
    code = ("import warnings\n"
            "try:\n    warnings.warn('x', DeprecationWarning)\nexcept DeprecationWarning:\n    print('raised')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "raised"


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements-lock.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9._-]+)==([^\s;]+)", line)
            assert m, f"requirements-lock.txt: not an exact pin: {line!r}"
            pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


@pytest.mark.parametrize("requirements", ["requirements-dev.txt", "requirements-integrations.txt"])
def test_every_requirement_is_pinned_and_satisfied_by_its_pin(requirements):
    pins = _pins()
    for line in (ROOT / requirements).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is in {requirements} but not pinned in requirements-lock.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (line, pins[name])
    assert "olmo-chunks" not in pins  # the package itself is built from the tree, never pinned


def test_env_sh_installs_under_the_lock_and_hashes_it():
    env = (ROOT / "scripts" / "env.sh").read_text()
    hash_line = next(line for line in env.splitlines() if line.startswith("HASH="))
    assert all(f"requirements-{name}.txt" in hash_line for name in ("dev", "integrations", "lock"))
    installs = [line for line in env.splitlines() if "pip install" in line]
    assert installs and all('-c "$ROOT/requirements-lock.txt"' in line for line in installs), installs
