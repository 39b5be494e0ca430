"""OLMo-core's own Trainer, CheckpointerCallback and FSDP train module on 2 gloo ranks, checkpointing
through `OlmoChunksCheckpointerConfig`; and a stock OLMo-core checkpoint migrated by import-dcp."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("olmo_core")
# the migrated checkpoint is loaded in this process, without a process group
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

from olmo_chunks import _core  # noqa: E402
from olmo_chunks.cli import main as cli_main  # noqa: E402

from tests import world  # noqa: E402

STEPS = 5
SEQ = 8
VOCAB = 64


def _environment() -> None:
    import torch.distributed as dist

    os.environ.update({"OLMO_SHARED_FS": "1", "LOCAL_RANK": str(dist.get_rank()), "LOCAL_WORLD_SIZE": "2"})


def _batch(epoch: int, index: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * epoch + 10 * index + rank)
    return {"input_ids": torch.randint(0, VOCAB, (2, SEQ), generator=g)}


def _loader(work_dir: str):
    """A deterministic in-memory data loader that resumes where its state says."""
    import torch.distributed as dist
    from olmo_core.data.collator import DataCollator
    from olmo_core.data.data_loader import TextDataLoaderBase

    class Loader(TextDataLoaderBase):
        total_batches = 100

        def state_dict(self) -> dict[str, Any]:
            return {"batches_processed": self.batches_processed, "epoch": self._epoch}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.batches_processed, self._epoch = state_dict["batches_processed"], state_dict["epoch"]

        def reshuffle(self, epoch: int | None = None, **kwargs: Any) -> None:
            self._epoch = epoch or self._epoch or 1

        def _iter_batches(self):
            for i in range(self.batches_processed, self.total_batches):
                yield _batch(self.epoch, i, self.dp_rank)

        def get_mock_batch(self) -> dict[str, Any]:
            return _batch(0, 0, self.dp_rank)

    return Loader(
        collator=DataCollator(pad_token_id=0),
        work_dir=work_dir,
        global_batch_size=2 * 2 * SEQ,
        dp_world_size=dist.get_world_size(),
        dp_rank=dist.get_rank(),
    )


def _train_module():
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerTrainModuleConfig

    torch.manual_seed(0)
    model = TransformerConfig.olmo2_1M(vocab_size=VOCAB, n_layers=2).build(init_device="cpu")
    return TransformerTrainModuleConfig(
        rank_microbatch_size=2 * SEQ,
        max_sequence_length=SEQ,
        optim=AdamWConfig(lr=1e-2),
        dp_config=TransformerDataParallelConfig(name=DataParallelType.fsdp),
    ).build(model, device=torch.device("cpu"))


def _full_state(train_module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor

    flat, _ = flatten_state_dict(train_module.state_dict_to_save())
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in flat.items()}


def _fit(folder: str, hard_stop: int | None, stock: bool) -> dict[str, Any]:
    """`Trainer.fit` as a user runs it: resumes from `folder` if it holds a checkpoint, saves every
    2 steps and at the end, stops after `hard_stop` steps if given. (Saves are synchronous here: with
    `save_async` the trainer records the save's duration from the save's thread, at a step that can
    differ between ranks, and OLMo-core's metric reduction, which found the ranks' metrics alike at
    the first step, can then hang; `_save_async_round_trip` covers `save_async`.)"""
    import olmo_core.distributed.parallel
    from olmo_chunks.integrations.olmo_core import OlmoChunksCheckpointerConfig
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import Callback, CheckpointerCallback

    @dataclass
    class Resumed(Callback):
        at: int = -1
        path: str | None = None

        def post_checkpoint_loaded(self, path: Any) -> None:
            self.path = str(path)

        def pre_train(self) -> None:
            self.at = self.trainer.global_step

    olmo_core.distributed.parallel._WORLD_MESH = None  # OLMo-core builds it once per process
    train_module = _train_module()
    config = TrainerConfig(
        save_folder=folder,
        work_dir=f"{folder}-work",
        max_duration=Duration.steps(STEPS),
        hard_stop=Duration.steps(hard_stop) if hard_stop else None,
        callbacks={"checkpointer": CheckpointerCallback(save_interval=2, save_async=False), "resumed": Resumed()},
    )
    if not stock:
        config.checkpointer = OlmoChunksCheckpointerConfig()  # the one-line switch
    trainer = config.build(train_module, _loader(f"{folder}-work"))
    trainer.fit()
    resumed = trainer.callbacks["resumed"]
    return {"loaded": trainer.checkpoint_loaded, "at": resumed.at, "path": resumed.path,
            "step": trainer.global_step, "state": _full_state(train_module), "module": train_module}


def _save_async_round_trip(folder: str, train_module: Any) -> list[str]:
    """`save_async`, then the module's state destroyed and loaded back: the mismatches."""
    import torch.distributed as dist
    from olmo_chunks.integrations.olmo_core import OlmoChunksCheckpointerConfig
    from olmo_core.utils import wait_for

    checkpointer = OlmoChunksCheckpointerConfig(work_dir=f"{folder}-work").build(process_group=dist.new_group())
    before = _full_state(train_module)
    checkpointer.save_async(folder, train_module, {"marker": 99}).result()
    wait_for(lambda: checkpointer.dir_is_checkpoint(folder), "the checkpoint's metadata")
    with torch.no_grad():
        for state in train_module.optim.state.values():
            state["exp_avg"].zero_()
        for p in train_module.model.parameters():
            p.zero_()
    assert checkpointer.latest_checkpoint(str(Path(folder).parent)) == folder
    assert checkpointer.load(folder, train_module) == {"marker": 99}
    return _equal(_full_state(train_module), before)


def olmo_core_jobs_worker(root: str, jobs: list[tuple[str, int | None, bool]], async_check: bool) -> list[Any]:
    """Runs the training `jobs` (folder, hard_stop, stock) one after another in this process."""
    _environment()
    out = []
    for folder, hard_stop, stock in jobs:
        r = _fit(f"{root}/{folder}", hard_stop, stock)
        if async_check:
            r["async"] = _save_async_round_trip(f"{root}/{folder}-async/step{r['step']}", r["module"])
        del r["module"]
        out.append(r)
    return out


def _job(root: Path, *jobs: tuple[str, int | None, bool], async_check: bool = False) -> list[list[dict[str, Any]]]:
    """One job of 2 new processes: per rank, the results of each training run."""
    world.shutdown()
    try:
        return world.run(2, olmo_core_jobs_worker, str(root), list(jobs), async_check, timeout=300)
    finally:
        world.shutdown()


def _equal(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])]


def test_trainer_resumes_switches_over_and_migrates(tmp_path: Path) -> None:
    """Two runs interrupted after 3 steps, one saving through olmo-chunks, one stock; restarted in
    new processes, both under olmo-chunks: each loads its step-3 checkpoint (olmo-chunks, stock)
    and ends with the model and AdamW state of an uninterrupted run, bit for bit; `save_async`
    round-trips. import-dcp turns the stock checkpoint into an olmo-chunks one that loads
    resharded, bit for bit."""
    whole, ours, stock = _job(tmp_path, ("whole", None, False), ("ours", 3, False), ("stock", 3, True))[0]
    assert not any(r["loaded"] for r in (whole, ours, stock)) and ours["step"] == stock["step"] == 3
    assert any(k.endswith("exp_avg_sq") for k in whole["state"])
    for step in (2, 3):
        store = tmp_path / "ours" / f"step{step}" / "model_and_optim"
        assert (store / _core.MANIFEST_NAME).is_file() and not (store / ".metadata").exists()
    assert (tmp_path / "stock" / "step3" / "model_and_optim" / ".metadata").is_file()

    resumed = _job(tmp_path, ("ours", None, False), ("stock", None, False), async_check=True)
    for rank in resumed:
        for run, r in zip(("ours", "stock"), rank, strict=True):
            assert r["loaded"] and r["at"] == 3 and r["path"] == str(tmp_path / run / "step3"), run
            assert r["step"] == STEPS and r["async"] == [], run
            assert _equal(r["state"], whole["state"]) == [], run
    assert (tmp_path / "stock" / "step4" / "model_and_optim" / _core.MANIFEST_NAME).is_file()

    src, dst = tmp_path / "stock" / "step3" / "model_and_optim", tmp_path / "migrated"
    assert cli_main(["import-dcp", str(src), str(dst)]) == 0
    assert _equal(_load_migrated(dst, sorted(stock["state"])), stock["state"]) == []


def _load_migrated(path: Path, keys: list[str]) -> dict[str, Any]:
    """Loads the migrated checkpoint through DCP into whole tensors in this one process (saved as
    2 FSDP shards): a resharded load."""
    import torch.distributed.checkpoint as dcp
    from olmo_chunks.dcp import ChunkStoreReader, FastLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = ChunkStoreReader(path).read_metadata().state_dict_metadata
    sd: dict[str, Any] = {
        k: torch.zeros(md[k].size, dtype=md[k].properties.dtype) if isinstance(md[k], TensorStorageMetadata) else None
        for k in keys
    }
    dcp.load(sd, storage_reader=ChunkStoreReader(path), planner=FastLoadPlanner(), no_dist=True)
    return sd


class _Module:
    """The flat-state-dict part of a TrainModule that the checkpointer uses."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.m = torch.nn.Linear(4, 3)

    def state_dict_to_save(self) -> dict[str, Any]:
        return {"model": self.m.state_dict()}

    def state_dict_to_load(self, metadata: Any, optim: bool | None = None) -> dict[str, Any]:
        return {"model": self.m.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.m.load_state_dict(sd["model"])


@dataclass
class _Opaque:
    x: int


def test_trainer_state_with_olmo_cores_enums_resumes(tmp_path: Path) -> None:
    """OLMo-core's ComposableDataLoader keeps its ShuffleStrategy (an enum) in the trainer state:
    it comes back, where it was refused (so such a run could not resume) until 2026-12-07. Other
    objects stay refused, with our error (the stock checkpointer unpickles anything)."""
    from olmo_chunks.errors import UnsupportedFormatError
    from olmo_chunks.integrations.olmo_core import OlmoChunksCheckpointerConfig
    from olmo_core.data.composable.data_loader import ShuffleStrategy

    checkpointer = OlmoChunksCheckpointerConfig().build(work_dir=tmp_path / "work")
    state = {"global_step": 3,
             "data_loader": {"batches_processed": 3, "shuffle_strategy": ShuffleStrategy.inter_source}}
    checkpointer.save(tmp_path / "step3", _Module(0), state)
    into = _Module(1)
    assert checkpointer.load(tmp_path / "step3", into) == state
    assert torch.equal(into.m.weight, _Module(0).m.weight)
    checkpointer.save(tmp_path / "step4", _Module(0), {"global_step": 4, "callback": _Opaque(1)})
    with pytest.raises(UnsupportedFormatError, match=r"rank0\.pt: the trainer state holds objects other than data"):
        checkpointer.load(tmp_path / "step4", _Module(1))
