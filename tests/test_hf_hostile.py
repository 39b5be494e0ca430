"""Hostile Hugging Face directories: damaged safetensors headers, indexes and configs, and files that
are not regular files. `import-hf` and `validate-conversion` refuse each with CorruptCheckpointError
naming the file and why, promptly (a FIFO never blocks them)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from olmo_chunks.cli import main
from olmo_chunks.errors import CorruptCheckpointError
from olmo_chunks.hf.common import MAX_JSON_BYTES
from olmo_chunks.hf.importer import import_hf
from olmo_chunks.hf.safetensors_io import INDEX_NAME
from olmo_chunks.hf.validate import validate_conversion

from tests.test_export import hf_config, olmoe_hf_oracle, olmoe_native, save_native, write_hf
from tests.test_hostile_files import run_with_deadline


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A native checkpoint (`native`) and its HF oracle in two shards (`hf`)."""
    root = tmp_path_factory.mktemp("hf_hostile")
    t = olmoe_native(seed=1)
    save_native(root / "native", t, moments=False)
    write_hf(root / "hf", olmoe_hf_oracle(t), hf_config(), shard=60_000)
    return root


def _shard(d: Path) -> Path:
    return sorted(d.glob("*.safetensors"))[0]


def _edit_header(d: Path, edit: Callable[[dict], bytes | dict]) -> Path:
    """Rewrites the first shard's header as `edit(header)` returns it (bytes as they are)."""
    p = _shard(d)
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    h = edit(json.loads(raw[8 : 8 + n]))
    h = h if isinstance(h, bytes) else json.dumps(h).encode()
    h += b" " * (-len(h) % 8)
    p.write_bytes(len(h).to_bytes(8, "little") + h + raw[8 + n :])
    return p


def _edit_entry(field: str, value: object) -> Callable[[Path], Path]:
    def edit(h: dict) -> dict:
        name = next(k for k in h if k != "__metadata__" and len(h[k]["shape"]) == 1)
        h[name][field] = value(h[name][field]) if callable(value) else value
        return h

    return lambda d: _edit_header(d, edit)


def _write(name: str, data: bytes) -> Callable[[Path], Path]:
    def mutate(d: Path) -> Path:
        (d / name).write_bytes(data)
        return d / name

    return mutate


def _huge(name: str) -> Callable[[Path], Path]:
    def mutate(d: Path) -> Path:
        with open(d / name, "wb") as f:
            f.truncate(MAX_JSON_BYTES + 1)  # sparse: refused by its size, never read
        return d / name

    return mutate


def _directory(name: str) -> Callable[[Path], Path]:
    def mutate(d: Path) -> Path:
        p = _shard(d) if name == "shard" else d / name
        p.unlink()
        p.mkdir()
        return p

    return mutate


def _weight_map_name(fname: str) -> Callable[[Path], Path]:
    def mutate(d: Path) -> Path:
        index = json.loads((d / INDEX_NAME).read_text())
        index["weight_map"][next(iter(index["weight_map"]))] = fname
        (d / INDEX_NAME).write_text(json.dumps(index))
        return d / INDEX_NAME

    return mutate


DEEP = b"[" * 100_000 + b"]" * 100_000
# id: (what to break, returning the file the error must name; what the error must say)
CASES = {
    # Before the fix: ValueError (Python's 4300-digit limit on int()).
    "header_huge_int": (
        lambda d: _edit_header(d, lambda h: b'{"__metadata__": {"a": ' + b"9" * 5000 + b"}}"),
        "header: not JSON (an integer of 5000 digits",
    ),
    "header_deep": (lambda d: _edit_header(d, lambda h: b'{"__metadata__": ' + DEEP + b"}"), "nested more than"),
    "header_moderately_deep": (
        lambda d: _edit_header(d, lambda h: b'{"__metadata__": ' + b"[" * 500 + b"]" * 500 + b"}"),
        "nested more than",
    ),
    "dtype_not_str": (_edit_entry("dtype", ["F32"]), "unknown dtype ['F32']"),  # TypeError: unhashable
    "shape_bool": (_edit_entry("shape", lambda s: [*s, True]), "bad shape"),  # imported as [n, 1]
    "shape_bool_only": (_edit_entry("shape", lambda s: [True] * len(s)), "bad shape"),
    "offsets_bool": (_edit_entry("data_offsets", lambda o: [False, o[1]] if o[0] == 0 else [o[0], True]), "bad data_"),
    "index_bad_utf8": (_write(INDEX_NAME, b'{"weight_map": {"\xff": "x"}}'), "not JSON ('utf-8' codec"),
    "index_deep": (_write(INDEX_NAME, DEEP), "nested more than"),  # RecursionError
    "index_huge_int": (
        _write(INDEX_NAME, b'{"weight_map": {}, "metadata": {"total_size": ' + b"9" * 5000 + b"}}"),
        "not JSON (an integer of 5000 digits",
    ),
    "index_not_object": (_write(INDEX_NAME, b"[1]"), "not a JSON object"),
    "index_huge": (_huge(INDEX_NAME), f"more than {MAX_JSON_BYTES} bytes"),
    "index_is_dir": (_directory(INDEX_NAME), "cannot read it (Is a directory)"),  # IsADirectoryError
    "index_names_dotdot": (_weight_map_name(".."), "file name '..' is not a plain name"),  # StorageError
    "index_names_empty": (_weight_map_name(""), "file name '' is not a plain name"),  # StorageError
    "shard_is_dir": (_directory("shard"), "not a regular file (a directory)"),  # StorageError
    "config_bad_utf8": (_write("config.json", b'{"model_type": "\xff"}'), "not JSON ('utf-8' codec"),
    "config_list": (_write("config.json", b"[1, 2]"), "not a JSON object"),  # AttributeError
    "config_string": (_write("config.json", b'"olmoe"'), "not a JSON object"),  # AttributeError
    "config_deep": (_write("config.json", b'{"a": ' + DEEP + b"}"), "nested more than"),
    "config_is_dir": (_directory("config.json"), "cannot read it (Is a directory)"),  # IsADirectoryError
}


@pytest.mark.parametrize("case", CASES)
def test_hostile_hf_directory_is_refused_naming_the_file(good: Path, tmp_path: Path, case: str, capsys):
    d = tmp_path / "hf"
    shutil.copytree(good / "hf", d)
    mutate, why = CASES[case]
    bad = mutate(d)
    with pytest.raises(CorruptCheckpointError) as exc:
        import_hf(d, tmp_path / "out")
    assert type(exc.value) is CorruptCheckpointError
    assert str(exc.value).startswith(f"{bad}: ") and why in str(exc.value), str(exc.value)
    assert not (tmp_path / "out").exists()
    with pytest.raises(CorruptCheckpointError) as exc:
        validate_conversion(good / "native", d, round_trip=False)
    assert type(exc.value) is CorruptCheckpointError
    assert str(exc.value).startswith(f"{bad}: ") and why in str(exc.value), str(exc.value)
    # The command line: one error line, and validate-conversion's failing report.
    assert main(["import-hf", str(d), str(tmp_path / "out")]) == 1
    report = tmp_path / "r.json"
    assert main(["validate-conversion", "--native", str(good / "native"), "--hf", str(d), "--report", str(report)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert [e.split(": error: ", 1)[1] for e in err] == [str(exc.value)] * 2, err
    assert json.loads(report.read_text())["ok"] is False


def test_bool_shape_is_not_read_as_an_integer(good: Path, tmp_path: Path):
    # `[32, true]` was imported as shape [32, 1]: the reference reader refuses it, so must we.
    shutil.copytree(good / "hf", tmp_path / "hf")
    p = _edit_entry("shape", lambda s: [*s, True])(tmp_path / "hf")
    with pytest.raises(CorruptCheckpointError, match=r"has a bad shape \[\d+, True\] \(not a list of non-negative"):
        import_hf(tmp_path / "hf", tmp_path / "out")
    assert p.exists()


@pytest.mark.parametrize("which", ["shard", INDEX_NAME, "config.json"])
def test_fifo_in_an_hf_directory_is_refused_within_seconds(good: Path, tmp_path: Path, which: str):
    d = tmp_path / "hf"
    shutil.copytree(good / "hf", d)
    f = _shard(d) if which == "shard" else d / which
    f.unlink()
    os.mkfifo(f)
    try:
        for what, fn in [
            ("import_hf", lambda: import_hf(d, tmp_path / "out")),
            ("validate", lambda: validate_conversion(good / "native", d, round_trip=False)),
            ("cli", lambda: main(["import-hf", str(d), str(tmp_path / "out")])),
        ]:
            status, value = run_with_deadline(fn)
            assert status != "blocked", f"{what} blocked on a FIFO"
            if what == "cli":
                assert (status, value) == ("ok", 1)
            else:
                assert status == "raised" and type(value) is CorruptCheckpointError, (what, value)
                assert str(value) == f"{f}: not a regular file (a FIFO)"
    finally:
        # Release any reader a regression left blocked in open().
        with contextlib.suppress(OSError):
            os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))


def test_symlinked_files_are_followed(good: Path, tmp_path: Path):
    # The HF cache links every file of a snapshot to a blob: links are followed, not refused.
    d = tmp_path / "hf"
    d.mkdir()
    for p in (good / "hf").iterdir():
        (d / p.name).symlink_to(p)
    s = import_hf(d, tmp_path / "out")
    assert s["tensors"] > 0
