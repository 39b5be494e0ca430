"""Pipeline stages save their own layers under global names; a rank loads only the layers it owns
with `load(..., partial=True)`, which still checks every key it does hold."""

import olmo_chunks as oc
import pytest
import torch
import torch.distributed as dist
from olmo_chunks.errors import MismatchError
from torch.distributed.tensor import DTensor, Shard

from tests import world

LAYERS = 4


def layer_value(layer: int) -> torch.Tensor:
    return torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5) + 100 * layer


def test_partial_skips_other_keys_but_checks_its_own(tmp_path):
    path = tmp_path / "ck"
    oc.save({"a": torch.ones(3), "b": torch.zeros(2), "n": 3}, path)
    a = torch.empty(3)
    report = oc.load({"a": a}, path, partial=True)
    assert torch.equal(a, torch.ones(3)) and report.loaded == ["a"] and report.ok
    with pytest.raises(MismatchError) as info:
        oc.load({"a": torch.empty(3)}, path)
    assert sorted(info.value.mismatches) == ["b: in the checkpoint but not in the state dict",
                                             "n: in the checkpoint but not in the state dict"]
    with pytest.raises(MismatchError, match=r"shape=\(3,\).*shape=\(4,\)"):
        oc.load({"a": torch.empty(4)}, path, partial=True)
    with pytest.raises(MismatchError, match="c: missing from the checkpoint"):
        oc.load({"a": torch.empty(3), "c": torch.empty(1)}, path, partial=True)
    report = oc.load({"a": torch.empty(3), "c": torch.empty(1)}, path, partial=True, strict=False)
    assert report.missing == ["c"] and report.unexpected == []


def _stage_state(pp: int, fill: bool) -> dict:
    """This rank's layers for `pp` stages over the world, each layer a DTensor sharded over the
    stage's ranks (Shard(0), uneven where it must be)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    per_stage = size // pp
    stage = rank // per_stage
    dp_mesh = _stage_mesh(pp, per_stage)
    out = {}
    for layer in range(stage * LAYERS // pp, (stage + 1) * LAYERS // pp):
        full = layer_value(layer)
        chunks = torch.chunk(full, per_stage)
        i = rank % per_stage
        local = chunks[i].clone() if i < len(chunks) else full[:0].clone()
        if not fill:
            local.fill_(float("nan"))
        out[f"model.layers.{layer}.w"] = DTensor.from_local(local, dp_mesh, [Shard(0)], run_check=False,
                                                            shape=full.shape, stride=full.stride())
    return out


_MESHES: dict = {}


def _stage_mesh(pp, per_stage):
    if (pp, per_stage) not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[(pp, per_stage)] = init_device_mesh("cpu", (pp, per_stage), mesh_dim_names=("pp", "dp"))
    return _MESHES[(pp, per_stage)]["dp"]


def _save(path, pp):
    oc.save({**_stage_state(pp, True), "meta": {"pp": pp}}, path)


def _load(path, pp):
    state = _stage_state(pp, False)
    report = oc.load(state, path, partial=True)
    ok = all(torch.equal(v.full_tensor(), layer_value(int(k.split(".")[2]))) for k, v in state.items())
    return report.loaded, report.unexpected, ok


@pytest.mark.parametrize("load_pp", [1, 4, 2])
def test_pp2_checkpoint_loads_on_other_pp(tmp_path, load_pp):
    path = str(tmp_path / "ck")
    world.run(4, _save, path, 2)
    tensors = {t.key for t in oc._core.Manifest.open(path).tensors}
    assert tensors == {f"model.layers.{i}.w" for i in range(LAYERS)}  # global names, no stage ids
    out = world.run(4, _load, path, load_pp)
    loaded = [set(r[0]) for r in out]
    assert all(r[2] for r in out) and all(r[1] == [] for r in out)
    assert set().union(*loaded) == tensors  # between them, the ranks own every layer
    per_stage = 4 // load_pp
    for rank, keys in enumerate(loaded):
        stage = rank // per_stage
        assert keys == {f"model.layers.{i}.w" for i in range(stage * LAYERS // load_pp,
                                                             (stage + 1) * LAYERS // load_pp)}
