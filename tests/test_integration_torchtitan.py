"""torchtitan's own CheckpointManager machinery (its ModelWrapper, OptimizersContainer,
LRSchedulersContainer, step folders and async save) on 2 gloo ranks with an FSDP2 model,
checkpointing through `ChunkStoreCheckpointManager`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan")
# the migrated checkpoint is compared in this process, without a process group
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

import torch.distributed.checkpoint as dcp  # noqa: E402
from olmo_chunks import _core  # noqa: E402
from olmo_chunks.dcp import ChunkStoreReader, import_dcp  # noqa: E402
from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: E402

from tests import world  # noqa: E402

STEPS = 6


class _Counter:
    """A Stateful stand-in for torchtitan's trainer and data loader states."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]


def _full_state(model: torch.nn.Module, optimizers: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor

    flat, _ = flatten_state_dict({"model": model.state_dict(), "optim": optimizers.state_dict()})
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in flat.items()}


def titan_train_worker(folder: str, stop: int, stock: bool, async_mode: str = "disabled",
                       initial_load_path: str | None = None) -> dict[str, Any]:
    """A torchtitan training loop: load (latest in `folder`, else `initial_load_path`), then train
    steps up to `stop`, saving every 2 steps (and a full state at the last step)."""
    import torch.distributed as dist
    from olmo_chunks.integrations.torchtitan import ChunkStoreCheckpointManager
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fully_shard(model, mesh=world.mesh((2,)))
    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)
    train_state, data = _Counter(), _Counter()
    manager = (CheckpointManager if stock else ChunkStoreCheckpointManager).Config(
        enable=True,
        interval=2,
        async_mode=async_mode,
        last_save_model_only=False,
        initial_load_path=initial_load_path,
        initial_load_model_only=False,
    ).build(
        dataloader=data,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=folder,
    )
    loaded = manager.load()
    start = train_state.step
    while train_state.step < stop:
        train_state.step += 1
        g = torch.Generator().manual_seed(100 * train_state.step + dist.get_rank())
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        optimizers.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizers.step()
        lr_schedulers.step()
        data.step += 1
        manager.save(train_state.step, last_step=train_state.step == STEPS)
    manager.maybe_wait_for_saving()
    manager.close()
    return {"loaded": loaded, "start": start, "data": data.step, "state": _full_state(model, optimizers)}


def titan_jobs_worker(jobs: list[tuple]) -> list[dict[str, Any]]:
    return [titan_train_worker(*job) for job in jobs]


def _job(*jobs: tuple) -> list[dict[str, Any]]:
    """One job of 2 new processes: rank 0's results of each training run."""
    world.shutdown()
    try:
        return world.run(2, titan_jobs_worker, list(jobs), timeout=300)[0]
    finally:
        world.shutdown()


def _equal(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])]


def _whole(reader: Any) -> dict[str, Any]:
    """Everything a checkpoint holds, loaded into whole tensors in this process."""
    md = reader.read_metadata().state_dict_metadata
    sd = {k: torch.zeros(m.size, dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None
          for k, m in md.items()}
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd


def test_checkpoint_manager_resumes_bit_exact(tmp_path: Path) -> None:
    """Runs killed after step 3 (last checkpoint: step 2, one saved async, one stock) restart in new
    processes: the olmo-chunks one resumes from its latest step folder, the other starts from the
    stock checkpoint as its initial_load_path; both end with the model, AdamW and schedule state of
    an uninterrupted run, bit for bit. import-dcp migrates the stock checkpoint, bit for bit."""
    ours, stock, whole = (str(tmp_path / name) for name in ("ours", "stock", "whole"))
    first = _job((whole, STEPS, False), (ours, 3, False, "async"), (stock, 3, True))
    assert not any(r["loaded"] for r in first)
    for step in (2, 4, 6):
        assert (tmp_path / "whole" / "checkpoint" / f"step-{step}" / _core.MANIFEST_NAME).is_file()
    assert (tmp_path / "ours" / "checkpoint" / "step-2" / _core.MANIFEST_NAME).is_file()  # saved async
    stock_step2 = tmp_path / "stock" / "checkpoint" / "step-2"
    assert (stock_step2 / ".metadata").is_file()

    switched = str(tmp_path / "switched")
    resumed, from_stock = _job((ours, STEPS, False), (switched, STEPS, False, "disabled", str(stock_step2)))
    for r in (resumed, from_stock):
        assert r["loaded"] and r["start"] == 2 and r["data"] == STEPS
        assert _equal(r["state"], first[0]["state"]) == []
    assert (tmp_path / "switched" / "checkpoint" / "step-6" / _core.MANIFEST_NAME).is_file()

    # migration: import-dcp of the stock checkpoint holds the same keys and values, bit for bit
    assert import_dcp(stock_step2, tmp_path / "migrated")["tensors"] > 0
    stock_sd, migrated = _whole(dcp.FileSystemReader(stock_step2)), _whole(ChunkStoreReader(tmp_path / "migrated"))
    assert any(k.startswith("optimizer.state.") for k in stock_sd) and stock_sd["train_state.step"] == 2
    assert _equal(migrated, stock_sd) == []
