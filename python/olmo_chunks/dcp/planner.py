"""`FastLoadPlanner`: DCP's default load planner with read items from the Rust band index."""


from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
)
from torch.distributed.tensor import DTensor

from .. import _core

try:  # private helper, present in every supported torch; keeps chunk lists identical to DCP's
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
except ImportError:  # pragma: no cover
    _create_chunk_list = None  # type: ignore[assignment]


class FastLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` whose read items come from the Rust band index: the same items (one
    per overlap of a saved chunk and a local chunk), planned in `O((S + L) log S + overlaps)` per
    tensor on 1-D and 2-D layouts alike. Works with any storage reader."""

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata
        assert md is not None
        if self.flatten_state_dict:
            self._match_pre_2_4_keys(md)
        strict = not self.allow_partial_load
        requests: list[ReadItem] = []
        batch: list[tuple[str, torch.Size, list[ChunkStorageMetadata], list[ChunkStorageMetadata], int]] = []
        for fqn, obj in self.state_dict.items():
            if fqn not in md.state_dict_metadata:
                if strict:
                    raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
                continue
            smd = md.state_dict_metadata[fqn]
            if isinstance(smd, BytesStorageMetadata):
                requests.append(
                    ReadItem(
                        type=LoadItemType.BYTE_IO,
                        dest_index=MetadataIndex(fqn),
                        dest_offsets=torch.Size((0,)),
                        storage_index=MetadataIndex(fqn),
                        storage_offsets=torch.Size((0,)),
                        lengths=torch.Size((0,)),
                    )
                )
                continue
            if getattr(obj, "size", None) is not None:
                global_shape = getattr(obj, "global_shape", None)  # DCP's CheckpointableTensor
                obj_size = torch.Size(global_shape) if global_shape is not None else obj.size()
                if smd.size != obj_size:
                    raise ValueError(
                        f"Size mismatch between saved {smd.size} and current: {obj_size} for {fqn}"
                    )
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue
            local = _local_chunks(fqn, obj)
            batch.append((fqn, smd.size, smd.chunks, local, len(requests)))
            requests.append(None)  # type: ignore[arg-type]  # placeholder, keeps state-dict order
        slots = dict(
            zip(
                (slot for *_, slot in batch),
                read_items_for_chunk_lists(
                    [(fqn, size, saved, local) for fqn, size, saved, local, _ in batch]
                ),
                strict=True,
            )
        )
        out: list[ReadItem] = []
        for i, r in enumerate(requests):
            out.extend(slots[i] if r is None else [r])
        return LoadPlan(out)

    def _match_pre_2_4_keys(self, md: Metadata) -> None:
        """As DefaultLoadPlanner does: if checkpoint keys are missing from the flattened state
        dict, try DCP's pre-2.4 flattening, which keys checkpoints saved by torch <= 2.3."""
        missing = set(md.state_dict_metadata) - set(self.state_dict)
        if not missing:
            return
        try:
            from torch.distributed.checkpoint import _version
            from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        except ImportError:  # pragma: no cover
            return
        _version._derived_version = "2_3"
        try:
            old_sd, old_mappings = flatten_state_dict(self.original_state_dict)
        finally:
            _version._derived_version = None
        if set(old_sd) & missing:
            self.state_dict, self.mappings = old_sd, old_mappings


def read_items_for_chunk_lists(
    tensors: list[tuple[str, torch.Size, Sequence[ChunkStorageMetadata], list[ChunkStorageMetadata]]],
) -> list[list[ReadItem]]:
    """Per `(fqn, global size, saved chunks, local chunks)`: the read items DCP's
    `create_read_items_for_chunk_list` makes (one per overlapping saved/local pair, same indices
    and offsets), computed by the Rust band index. Saved chunks that `ChunkStoreReader` listed
    (`SavedChunks`) are read from its manifest, with no Python object per saved chunk."""
    from .reader import SavedChunks

    def boxes(chunks: Sequence[ChunkStorageMetadata]) -> list[_core.Box]:
        return [_core.Box(list(c.offsets), list(c.sizes)) for c in chunks]

    hits: list[list[_core.Overlap]] = [[] for _ in tensors]
    lazy: dict[int, list[int]] = {}  # manifest -> positions of its tensors
    for i, (_, size, saved, local) in enumerate(tensors):
        if isinstance(saved, SavedChunks):
            lazy.setdefault(id(saved.manifest), []).append(i)
        else:
            hits[i] = _core.box_overlaps(len(size), boxes(saved), boxes(local))
    for positions in lazy.values():
        lists = [tensors[i][2] for i in positions]
        got = lists[0].manifest.overlaps([s.tensor for s in lists],  # type: ignore[attr-defined]
                                         [boxes(tensors[i][3]) for i in positions])
        for i, h in zip(positions, got, strict=True):
            hits[i] = h
    out = []
    for (fqn, _, _, local), found in zip(tensors, hits, strict=True):
        items = []
        for hit in found:
            lc = local[hit.wanted]
            items.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(fqn, lc.offsets, hit.wanted),
                    dest_offsets=torch.Size([o - b for o, b in zip(hit.offsets, lc.offsets, strict=True)]),
                    storage_index=MetadataIndex(fqn, torch.Size(hit.saved_offsets), hit.saved),
                    storage_offsets=torch.Size([o - b for o, b in zip(hit.offsets, hit.saved_offsets, strict=True)]),
                    lengths=torch.Size(hit.sizes),
                )
            )
        out.append(items)
    return out


def _local_chunks(fqn: str, obj: Any) -> list[ChunkStorageMetadata]:
    """The chunks of the global tensor this rank holds in `obj`, exactly as DCP lists them."""
    if _create_chunk_list is not None:
        try:
            return _create_chunk_list(obj)
        except ValueError as exc:
            raise ValueError(
                f"Invalid checkpoint metadata for {fqn}, expected BytesStorageMetadata "
                f"but found a tensor entry"
            ) from exc
    if hasattr(obj, "__create_chunk_list__"):  # pragma: no cover  (DTensor)
        return obj.__create_chunk_list__()
    if isinstance(obj, torch.Tensor):  # pragma: no cover
        return [ChunkStorageMetadata(offsets=torch.Size([0] * obj.dim()), sizes=obj.size())]
    raise ValueError(f"{fqn}: unsupported type {type(obj).__name__}")  # pragma: no cover
