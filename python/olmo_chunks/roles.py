"""Tensor roles: what a saved tensor is for. Recorded per tensor, checked on load."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .errors import InvalidArgumentError

if TYPE_CHECKING:  # torch-free at run time: the CLI's inspect and verify import this module
    import torch

__all__ = [
    "EXP_AVG",
    "EXP_AVG_SQ",
    "MAIN_WEIGHT",
    "OPTIMIZER_STATE",
    "ROLES",
    "TENSOR",
    "TRAINER_STATE",
    "check_roles",
    "infer_role",
    "resolve_role",
]

MAIN_WEIGHT = "main_weight"
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
OPTIMIZER_STATE = "optimizer_state"
TRAINER_STATE = "trainer_state"
TENSOR = "tensor"
ROLES = (MAIN_WEIGHT, EXP_AVG, EXP_AVG_SQ, OPTIMIZER_STATE, TRAINER_STATE, TENSOR)

_OPTIM = {"optim", "optimizer", "optimizer_state", "optim_state"}
_TRAINER = {"trainer", "train", "trainer_state", "train_state", "rng", "data_loader"}


def infer_role(key: str, tensor: torch.Tensor) -> str:
    """The role a tensor gets when none is given, from its dotted key.

    `...exp_avg` / `...exp_avg_sq` are Adam moments, anything else under an `optim`/`optimizer`
    component is optimizer bookkeeping, anything under `trainer`/`rng`/`data_loader` is trainer
    state, `...main` and other floating tensors are main weights, the rest plain tensors.
    """
    parts = key.split(".")
    if parts[-1] == EXP_AVG_SQ:
        return EXP_AVG_SQ
    if parts[-1] == EXP_AVG:
        return EXP_AVG
    if any(p in _OPTIM for p in parts):
        return MAIN_WEIGHT if parts[-1] == "main" else OPTIMIZER_STATE
    if any(p in _TRAINER for p in parts):
        return TRAINER_STATE
    return MAIN_WEIGHT if tensor.is_floating_point() else TENSOR


def check_roles(roles: Any) -> dict[str, str] | None:
    """A `roles=` argument (keys or dotted key prefixes to roles) as a dict; `InvalidArgumentError`
    for anything else, or a role not in `ROLES` (a misspelt one would be saved as it is)."""
    if roles is None:
        return None
    if not isinstance(roles, Mapping):
        raise InvalidArgumentError(f"roles must be a mapping, got {type(roles).__name__}")
    for key, role in roles.items():
        if not isinstance(key, str) or not isinstance(role, str) or role not in ROLES:
            raise InvalidArgumentError(f"roles[{key!r}]={role!r}: expected one of {', '.join(ROLES)}")
    return dict(roles)


def resolve_role(key: str, tensor: torch.Tensor, roles: Mapping[str, str] | None) -> str:
    """The explicit role for `key` (exact key, else the longest dotted prefix in `roles`), else the
    inferred one."""
    if roles:
        probe = key
        while True:
            if probe in roles:
                return roles[probe]
            if "." not in probe:
                break
            probe = probe.rsplit(".", 1)[0]
    return infer_role(key, tensor)
