"""An independent reader/writer of the manifest container, written from docs/FORMAT.md, used to
plant faults that a correct writer would never produce."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

MAGIC = b"OCHUNKS\n"
HEADER = struct.Struct("<8sIIQQQII16x")


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

    @classmethod
    def parse(cls, data: bytes) -> RawManifest:
        magic, version, _flags, meta_len, table_len, crc_len, body_crc, head_crc = HEADER.unpack_from(data)
        assert magic == MAGIC
        assert crc32c(data[:44]) == head_crc
        body = data[64:]
        assert crc32c(body) == body_crc and len(body) == meta_len + table_len + crc_len
        meta = json.loads(body[:meta_len])
        return cls(version, meta, body[meta_len : meta_len + table_len], body[meta_len + table_len :])

    def encode(self) -> bytes:
        meta = json.dumps(self.meta).encode()
        body = meta + self.table + self.checksums
        head = struct.pack("<8sIIQQQI", MAGIC, self.version, 0, len(meta), len(self.table), len(self.checksums),
                           crc32c(body))
        return head + struct.pack("<I", crc32c(head)) + bytes(16) + body
