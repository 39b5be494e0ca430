"""The CLI starts at once and owns its subcommand table: `--help`, `inspect` and `verify` import no
torch, each subcommand's module is imported only when it runs, a module that fails to import is a
one-line error, and progress bars appear only on a terminal."""

from __future__ import annotations

import dataclasses
import importlib
import io
import subprocess
import sys
import time
from pathlib import Path

import olmo_chunks
import pytest
import torch
from olmo_chunks import cli

# Runs the CLI in a fresh interpreter, then fails unless torch stayed unimported.
NO_TORCH = """
import sys, olmo_chunks.cli as c
try:
    rc = c.main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
torch = sorted(m for m in sys.modules if m.split(".")[0] == "torch")
assert not torch, f"torch was imported: {torch[:5]}"
sys.exit(rc)
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    olmo_chunks.save({"model": {"w": torch.randn(1000)}, "optim": {"w": {"exp_avg": torch.randn(1000)}},
                      "trainer": {"step": 3}}, path, block_size=1024)
    return path


@pytest.mark.parametrize(("argv", "expect"), [
    (["inspect", "{ckpt}"], "P = 1000 main-weight parameters"),
    (["verify", "{ckpt}"], "OK {ckpt}: 2 tensors"),
    (["--help"], "validate-conversion"),
])
def test_help_inspect_and_verify_import_no_torch(ckpt: Path, argv: list[str], expect: str) -> None:
    argv = [a.format(ckpt=ckpt) for a in argv]
    out = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert expect.format(ckpt=ckpt) in out.stdout


def test_package_import_is_torch_free() -> None:
    code = ("import sys, olmo_chunks as oc; oc.errors.ChecksumError; oc.OlmoChunksError; oc.roles.ROLES; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'torch']")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_library_modules_do_not_import_the_cli() -> None:
    code = ("import sys, olmo_chunks.dcp, olmo_chunks.hf.export, olmo_chunks.hf.importer, olmo_chunks.hf.validate, "
            "olmo_chunks.bench; assert 'olmo_chunks.cli' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_every_subcommand_resolves_and_configures() -> None:
    assert [c.name for c in cli.COMMANDS] == [
        "inspect", "verify", "import-dcp", "export", "import-hf", "validate-conversion", "bench"]
    for c in cli.COMMANDS:
        module = importlib.import_module(c.module)
        getattr(module, c.configure)(cli.argparse.ArgumentParser())
        assert callable(getattr(module, c.run))


def test_a_subcommand_whose_module_fails_to_import_is_a_one_line_error(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    broken = [dataclasses.replace(c, module="olmo_chunks._no_such_module") if c.name == "export" else c
              for c in cli.COMMANDS]
    monkeypatch.setattr(cli, "COMMANDS", broken)
    assert cli.main(["export", str(ckpt), "out"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "olmo-chunks export: error: ModuleNotFoundError: No module named 'olmo_chunks._no_such_module'"]
    assert cli.main(["inspect", "--no-tensors", str(ckpt)]) == 0  # the others still work
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0 and "export" in capsys.readouterr().out


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_only_on_a_terminal(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["verify", str(ckpt)]) == 0
    assert capsys.readouterr().err == ""  # not a terminal: no bar
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert cli.main(["verify", str(ckpt)]) == 0
    assert "verify" in tty.getvalue() and "7.81k" in tty.getvalue()  # 8000 bytes, in KiB
    with cli._watching("export", str(tmp_path)):
        (tmp_path / "f.bin").write_bytes(b"x" * 3000)
        time.sleep(1.2)
    assert "export" in tty.getvalue() and "2.93k" in tty.getvalue()  # 3000 bytes, in KiB


def test_a_bench_that_would_fill_the_disk_is_refused_before_it_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A full disk mid-run left the ranks unable to write their errors down ("EOFError: Ran out of
    # input"); the room the run needs is checked first, and nothing is spawned or written.
    assert cli.main(["bench", "--dir", str(tmp_path), "--size-gb", "100000"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("olmo-chunks bench: error: the benchmark of a 100000 GiB state holds about "), err
    assert f"under {tmp_path} and " in err and "pass --dir on a larger filesystem" in err, err
    assert not list(tmp_path.iterdir())
