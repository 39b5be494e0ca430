"""The CLI starts at once and owns its subcommand table: `--help`, `inspect` and `verify` import no
torch, each subcommand's module is imported only when it runs, a module that fails to import is a
one-line error, and progress bars appear only on a terminal."""

from __future__ import annotations

import dataclasses
import importlib
import io
import re
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
        getattr(module, c.configure)(cli._Parser())
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


BIG = "1" + "0" * 400
USAGE = 2  # argparse's usage error: the usage, then the error line
# id: (argv, exit status, the error line after "olmo-chunks <command>: error: ")
_LOCAL_ONLY = " must be a local directory, not a URL (only olmo-chunks checkpoints live in object stores)"
BAD = {
    "verify-workers": ("verify {ckpt} --workers -1", USAGE,
                       "argument --workers: '-1' is not a whole number from 1 to 1024"),
    "export-to-a-file": ("export --format safetensors {ckpt} {tmp}/file", 1,
                         "{tmp}/file: exists and is not a directory"),
    "export-over-an-export": ("export --format safetensors {ckpt} {tmp}/done", 1,
                              "{tmp}/done: a model is already exported there (model.safetensors.index.json); pass "
                              "overwrite=True (--overwrite) to replace it (nothing was changed)"),
    "export-workers": ("export --format safetensors --workers -3 {ckpt} {tmp}/out", USAGE,
                       "argument --workers: '-3' is not a whole number from 1 to 1024"),
    "export-huge-budget": (f"export --format safetensors --memory-budget {BIG} {{ckpt}} {{tmp}}/out", USAGE,
                           f"argument --memory-budget: '{BIG}' is too many bytes (at most 8 EiB)"),
    "export-shard-size": ("export --max-shard-size lots {ckpt} {tmp}/out", USAGE,
                          "argument --max-shard-size: cannot read 'lots' as a byte count"),
    "export-config-missing": ("export --config {tmp}/missing.json {ckpt} {tmp}/out", 1,
                              "HF config {tmp}/missing.json: cannot read it (No such file or directory)"),
    "export-config-not-json": ("export --config {tmp}/bad.json {ckpt} {tmp}/out", 1,
                               "HF config {tmp}/bad.json: not JSON (Expecting value: line 1 column 1 (char 0))"),
    "export-config-a-directory": ("export --config {tmp} {ckpt} {tmp}/out", 1,
                                  "HF config {tmp}: cannot read it (Is a directory)"),
    "export-config-a-list": ("export --config {tmp}/list.json {ckpt} {tmp}/out", 1,
                             "HF config {tmp}/list.json: not a JSON object"),
    "validate-config-not-json": (
        "validate-conversion --native {ckpt} --hf {tmp} --config {tmp}/bad.json --report {tmp}/r.json", 1,
        "HF config {tmp}/bad.json: not JSON (Expecting value: line 1 column 1 (char 0))"),
    "validate-report-nowhere": ("validate-conversion --native {ckpt} --hf {tmp} --report {tmp}/missing/r.json", USAGE,
                                "argument --report: cannot write '{tmp}/missing/r.json': no directory {tmp}/missing"),
    "validate-report-a-directory": ("validate-conversion --native {ckpt} --hf {tmp} --report {tmp}", USAGE,
                                    "argument --report: cannot write '{tmp}': it is a directory"),
    "import-hf-workers": ("import-hf {tmp} {tmp}/ck --workers 0", USAGE,
                          "argument --workers: '0' is not a whole number from 1 to 1024"),
    "import-dcp-workers": ("import-dcp {tmp} {tmp}/ck --workers -1", USAGE,
                           "argument --workers: '-1' is not a whole number from 1 to 1024"),
    "import-dcp-batch": ("import-dcp {tmp} {tmp}/ck --batch-mb -1", USAGE,
                         "argument --batch-mb: '-1' is not a whole number of MiB from 0 to 2**30"),
    "bench-size": ("bench --size-gb -1", USAGE, "argument --size-gb: '-1' is not a finite number >= 0"),
    "bench-pace": ("bench --storage-gbps inf", USAGE, "argument --storage-gbps: 'inf' is not a finite number >= 0"),
    "bench-reps": ("bench --reps 0", USAGE, "argument --reps: '0' is not a whole number from 1 to 1024"),
    "bench-json-nowhere": ("bench --json {tmp}/missing/b.json", USAGE,
                           "argument --json: cannot write '{tmp}/missing/b.json': no directory {tmp}/missing"),
    "bench-dir-missing": ("bench --dir {tmp}/missing --size-gb 0.001", 1, "{tmp}/missing: no such directory"),
    # Local only: each wrote or read the local directory `s3:/b/...` (export said OK), until 2026-12-07.
    "export-to-a-url": ("export {ckpt} s3://b/out --format safetensors", 1,
                        "s3://b/out: an export's output" + _LOCAL_ONLY),
    "import-hf-from-a-url": ("import-hf s3://b/hf {tmp}/ck", 1, "s3://b/hf: a Hugging Face model" + _LOCAL_ONLY),
    "import-dcp-from-a-url": ("import-dcp gs://b/dcp {tmp}/ck", 1,
                              "gs://b/dcp: a DCP FileSystemWriter checkpoint" + _LOCAL_ONLY),
    "validate-hf-a-url": ("validate-conversion --native {ckpt} --hf s3://b/hf --report {tmp}/r.json", 1,
                          "s3://b/hf: a Hugging Face model" + _LOCAL_ONLY),
}


@pytest.mark.parametrize(("argv", "rc", "error"), BAD.values(), ids=BAD.keys())
def test_bad_arguments_paths_and_config_files_are_one_line_errors(
        ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: str, rc: int, error: str) -> None:
    # They were raw Python exceptions (OverflowError, FileExistsError, FileNotFoundError,
    # JSONDecodeError, IsADirectoryError), a bad --report only after the whole validation had run.
    (tmp_path / "file").touch()
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "model.safetensors.index.json").write_text("{}")
    (tmp_path / "bad.json").write_text("not json")
    (tmp_path / "list.json").write_text("[1]")
    try:
        got = cli.main(argv.format(ckpt=ckpt, tmp=tmp_path).split())
    except SystemExit as e:
        got = e.code
    err = capsys.readouterr().err
    assert got == rc, err
    lines = err.splitlines()
    assert lines[-1] == f"olmo-chunks {argv.split()[0]}: error: " + error.format(tmp=tmp_path), err
    assert rc == USAGE or len(lines) == 1, err
    assert not re.search(r"\b\w+(Error|Exception)\b|Traceback", err), err
    assert (tmp_path / "done" / "model.safetensors.index.json").read_text() == "{}"  # nothing replaced
    assert not (tmp_path / "out").exists() and not (tmp_path / "ck").exists() and not Path("s3:").exists()


def test_a_reader_that_leaves_early_is_no_error(tmp_path: Path) -> None:
    # `inspect CKPT | head -1` printed "error: BrokenPipeError" (and Python's own at exit).
    olmo_chunks.save({f"layers.{i}.weight": torch.zeros(1) for i in range(4000)}, tmp_path / "c")  # a long listing
    out = subprocess.run(f"{sys.executable} -m olmo_chunks inspect {tmp_path / 'c'} | head -c 1", shell=True,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and len(out.stdout) == 1 and out.stderr == "", out
