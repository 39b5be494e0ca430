"""An independent reader/writer of the manifest container, written from docs/FORMAT.md, used to
plant faults that a correct writer would never produce."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

MAGIC = b"OCHUNKS\n"
HEADER = struct.Struct("<8sIIQQQII16x")  # bytes 48..56 hold the block length table's length in v2


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


@dataclass
class RawManifest:
    version: int
    meta: dict
    table: bytes
    checksums: bytes
    block_lens: bytes = b""  # version 2: one u32 stored length per block

    @classmethod
    def parse(cls, data: bytes) -> RawManifest:
        magic, version, _flags, meta_len, table_len, crc_len, body_crc, head_crc = HEADER.unpack_from(data)
        assert magic == MAGIC
        assert crc32c(data[:44]) == head_crc
        lens_len = struct.unpack_from("<Q", data, 48)[0] if version >= 2 else 0
        body = data[64:]
        assert crc32c(body) == body_crc and len(body) == meta_len + table_len + crc_len + lens_len
        meta = json.loads(body[:meta_len])
        crc_at = meta_len + table_len
        return cls(version, meta, body[meta_len:crc_at], body[crc_at : crc_at + crc_len], body[crc_at + crc_len :])

    def encode(self) -> bytes:
        meta = json.dumps(self.meta).encode()
        body = meta + self.table + self.checksums + self.block_lens
        head = struct.pack("<8sIIQQQI", MAGIC, self.version, 0, len(meta), len(self.table), len(self.checksums),
                           crc32c(body))
        lens = struct.pack("<Q", len(self.block_lens)) if self.version >= 2 else bytes(8)
        return head + struct.pack("<I", crc32c(head)) + lens + bytes(8) + body
