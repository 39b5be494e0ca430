"""Trainer state: counters, data-loader position, config, data manifest and per-rank RNG states,
saved with the model so a run resumes exactly.

Everything lives under the top-level key `trainer`: the global fields as plain values
(`trainer.step`, `trainer.tokens`, `trainer.epoch`, `trainer.seed`, `trainer.data_position`,
`trainer.config`, `trainer.data_manifest`, `trainer.extra`, `trainer.layout`), and each rank's RNG
states under `trainer.rng.rank{R:05d}` (`python` and `numpy` as data, `torch` and `cuda.{i}` as
uint8 tensors, role `trainer_state`).

RNG policy on load (`load_trainer_state`):
- the saved layout (world size plus the `layout` mapping given at save time) equals the current
  one on every rank: every rank's python, numpy, torch CPU and CUDA generators are restored
  exactly, so the run continues bit for bit;
- otherwise (a topology change): the counters and the data position are restored, and every rank
  reseeds all its generators from `derive_seed(seed, step, rank)` with its new rank. The old
  per-rank streams are not carried over: with another rank count there is no faithful mapping.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import _core, values
from ._dist import Group, rank_and_size
from .checkpoint import load
from .errors import InvalidArgumentError, MismatchError
from .location import checkpoint_location
from .tree import TRAINER_PREFIX, TRAINER_RNG_PREFIX

__all__ = [
    "PREFIX",
    "RNG_PREFIX",
    "Resumed",
    "TrainerState",
    "capture_rng",
    "derive_seed",
    "load_trainer_state",
    "reseed_rng",
    "restore_rng",
]

PREFIX = TRAINER_PREFIX
RNG_PREFIX = TRAINER_RNG_PREFIX
_FIELDS = ("step", "tokens", "epoch", "seed", "data_position", "config", "data_manifest", "extra")
# Fields that are dicts: DCP's flattening drops an empty one, so a checkpoint saved through the DCP
# door lacks it (read as {}).
_DICTS = ("data_position", "config", "extra")
RESTORED = "restored"
RESEEDED = "reseeded"


@dataclass
class TrainerState:
    """The run's global progress: identical on every rank.

    `data_position` is the data loader's resumable position (e.g. batches and tokens consumed,
    sampler epoch); `extra` holds callback state. All must be plain data (`values.py`)."""

    step: int = 0
    tokens: int = 0
    epoch: int = 0
    seed: int = 0
    data_position: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    data_manifest: Any = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def state_dict(self, *, layout: Mapping[str, Any] | None = None,
                   process_group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """`{"trainer": ...}` to merge into the state dict passed to `save`, with this rank's RNG
        states captured now. `layout` (e.g. `{"dp": 4, "ep_mp": 2, "ep_dp": 2, "pp": 1}`) is
        compared on load to decide whether RNG states are restored."""
        # No `Group`: this call is not collective, and a group made on some ranks only would
        # shift the keys of every later save and load there (a hang).
        rank, size = rank_and_size(process_group)
        out: dict[str, Any] = {}
        for name in _FIELDS:
            value = getattr(self, name)
            values.encode(value, f"{PREFIX}.{name}")  # refuse what cannot be stored, naming it
            out[name] = value
        out["layout"] = _layout(size, layout)
        out["rng"] = {_rank_key(rank): capture_rng()}
        return {PREFIX: out}


@dataclass
class Resumed:
    """What `load_trainer_state` restored: the state, and `rng` = "restored" (exact, same layout)
    or "reseeded" (layout changed; see the module docstring)."""

    state: TrainerState
    rng: str
    saved_layout: dict[str, Any]


def _rank_key(rank: int) -> str:
    return f"rank{rank:05d}"


def _layout(size: int, layout: Mapping[str, Any] | None) -> dict[str, Any]:
    out = {"world_size": size}
    if layout:
        if "world_size" in layout and layout["world_size"] != size:
            raise InvalidArgumentError(
                f"layout says world_size={layout['world_size']}, the group has {size}")
        out.update(layout)
    values.encode(out, f"{PREFIX}.layout")
    return out


def capture_rng() -> dict[str, Any]:
    """This process's python, numpy, torch CPU and (when present) CUDA generator states."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Sets every generator from `capture_rng`'s output (as saved and loaded)."""
    random.setstate(_tuples(state["python"]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def derive_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed that depends only on (run seed, step, rank)."""
    digest = hashlib.blake2b(f"olmo-chunks-rng:{seed}:{step}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def reseed_rng(seed: int) -> None:
    """Seeds python, numpy (with `seed mod 2**32`), torch CPU and every CUDA device."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_trainer_state(
    path: str | os.PathLike[str],
    *,
    layout: Mapping[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    verify: bool = True,
) -> Resumed:
    """Restores the trainer state saved at `path` (collective over `process_group`): counters,
    data position, config and data manifest always; RNG states exactly when the layout matches,
    else reseeded per rank (see the module docstring)."""
    with Group(process_group, op="load_trainer_state") as group:
        here = _layout(group.size, layout)

        def read() -> tuple[TrainerState, dict[str, Any], dict[str, Any] | None]:
            manifest = _core.Manifest.open(checkpoint_location(path))
            entries = values.entries(manifest)
            missing = [f"{PREFIX}.{n}: missing from the checkpoint" for n in (*_FIELDS, "layout")
                       if f"{PREFIX}.{n}" not in entries and n not in _DICTS]
            if missing:
                raise MismatchError(missing, header=f"{path}: no complete trainer state")
            state = TrainerState(**{n: values.decode(entries[f"{PREFIX}.{n}"], f"{PREFIX}.{n}") for n in _FIELDS
                                    if f"{PREFIX}.{n}" in entries})
            saved_layout = values.decode(entries[f"{PREFIX}.layout"], f"{PREFIX}.layout")
            prefix = f"{RNG_PREFIX}{_rank_key(group.rank)}."
            shapes = {t.key[len(prefix):]: t.shape for t in manifest.tensors if t.key.startswith(prefix)}
            mine: dict[str, Any] | None = None
            if saved_layout == here and "torch" in shapes:
                cuda = sorted(int(k.split(".")[1]) for k in shapes if k.startswith("cuda."))
                want_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
                if cuda == list(range(want_cuda)):
                    mine = {"python": None, "numpy": None,
                            "torch": torch.empty(shapes["torch"], dtype=torch.uint8)}
                    if cuda:
                        mine["cuda"] = [torch.empty(shapes[f"cuda.{i}"], dtype=torch.uint8) for i in cuda]
            return state, saved_layout, mine

        state, saved_layout, mine = group.agree(read)
        exact = all(group.all_gather(mine is not None))
        if exact:
            holder: dict[str, Any] = {PREFIX: {"rng": {_rank_key(group.rank): mine}}}
            load(holder, path, process_group=process_group, partial=True, verify=verify)
            group.agree(lambda: restore_rng(holder[PREFIX]["rng"][_rank_key(group.rank)]))
            return Resumed(state, RESTORED, saved_layout)
        reseed_rng(derive_seed(state.seed, state.step, group.rank))
        return Resumed(state, RESEEDED, saved_layout)
