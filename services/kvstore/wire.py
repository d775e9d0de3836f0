"""The gateway's binary wire format: batched KV pages as one HTTP body of raw bytes.

Pages are megabytes of tensor data; JSON (base64) would inflate them by a third and cost a copy
and an encode per page. A frame is a small fixed header, then the keys, then the page lengths,
then the pages' bytes concatenated (all integers little-endian):

    pages frame:  b"RKVP" | u32 count | count x 16-byte key | count x u32 length | data
    keys frame:   b"RKVK" | u32 count | count x 16-byte key

PUT /v1/pages takes a pages frame; POST /v1/pages/get takes a keys frame and answers a pages frame
holding the pages it found, in request order. Keys are block_manager.block_hash digests (16 bytes).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from pydantic import BaseModel

KEY_BYTES = 16
PAGES_MAGIC = b"RKVP"
KEYS_MAGIC = b"RKVK"
_HEAD = struct.Struct("<4sI")
MEDIA_TYPE = "application/x-relay-kv-pages"


class FrameError(ValueError):
    """A malformed frame; the message says what is wrong (the gateway answers 400 with it)."""


def encode_keys(keys: Sequence[bytes]) -> bytes:
    _check_keys(keys)
    return _HEAD.pack(KEYS_MAGIC, len(keys)) + b"".join(keys)


def decode_keys(body: bytes) -> list[bytes]:
    count = _header(body, KEYS_MAGIC)
    end = _HEAD.size + count * KEY_BYTES
    if len(body) != end:
        raise FrameError(f"keys frame of {count} keys must be {end} bytes, got {len(body)}")
    return [body[_HEAD.size + i * KEY_BYTES : _HEAD.size + (i + 1) * KEY_BYTES] for i in range(count)]


def encode_pages(keys: Sequence[bytes], pages: Sequence[bytes | memoryview]) -> bytes:
    if len(keys) != len(pages):
        raise FrameError(f"{len(keys)} keys for {len(pages)} pages")
    _check_keys(keys)
    lengths = struct.pack(f"<{len(pages)}I", *(len(p) for p in pages))
    return b"".join([_HEAD.pack(PAGES_MAGIC, len(keys)), *keys, lengths, *pages])


def encode_uniform_pages(keys: Sequence[bytes], data: bytes, page_bytes: int) -> bytes:
    """A pages frame from one buffer of len(keys) equal-size pages (kv_transfer.export_pages)."""
    if len(data) != len(keys) * page_bytes:
        raise FrameError(f"{len(data)} bytes for {len(keys)} pages of {page_bytes} bytes")
    _check_keys(keys)
    lengths = struct.pack(f"<{len(keys)}I", *([page_bytes] * len(keys)))
    return b"".join([_HEAD.pack(PAGES_MAGIC, len(keys)), *keys, lengths, data])


def decode_pages(body: bytes | memoryview) -> list[tuple[bytes, memoryview]]:
    """(key, page bytes) per page; the pages are views into `body` (no copy)."""
    view = memoryview(body)
    count = _header(view, PAGES_MAGIC)
    keys_end = _HEAD.size + count * KEY_BYTES
    lens_end = keys_end + 4 * count
    if len(view) < lens_end:
        raise FrameError(f"pages frame of {count} pages is truncated in its keys or lengths")
    lengths = struct.unpack_from(f"<{count}I", view, keys_end)
    if len(view) != lens_end + sum(lengths):
        raise FrameError(
            f"pages frame: lengths add up to {sum(lengths)} bytes, body has {len(view) - lens_end}"
        )
    out = []
    off = lens_end
    for i, n in enumerate(lengths):
        key = bytes(view[_HEAD.size + i * KEY_BYTES : _HEAD.size + (i + 1) * KEY_BYTES])
        out.append((key, view[off : off + n]))
        off += n
    return out


def _header(body: bytes | memoryview, magic: bytes) -> int:
    if len(body) < _HEAD.size:
        raise FrameError(f"frame shorter than its {_HEAD.size}-byte header")
    got, count = _HEAD.unpack_from(body, 0)
    if got != magic:
        raise FrameError(f"frame magic {bytes(got)!r}, expected {magic!r}")
    return int(count)


def _check_keys(keys: Sequence[bytes]) -> None:
    bad = next((i for i, k in enumerate(keys) if len(k) != KEY_BYTES), None)
    if bad is not None:
        raise FrameError(f"key {bad} has {len(keys[bad])} bytes, expected {KEY_BYTES}")


# ---------------------------------------------------------------------- JSON replies


class TierStats(BaseModel):
    name: str
    budget_bytes: int
    used_bytes: int
    pages: int
    hits: int
    puts: int
    demotions: int  # pages moved down to the next tier when over budget
    promotions: int  # pages moved up to RAM when read from here
    evictions: int  # pages dropped from the last tier
    errors: int


class StoreStats(BaseModel):
    gets: int
    misses: int
    tiers: list[TierStats]


class PutReply(BaseModel):
    stored: int
    bytes: int


class DataPlaneInfo(BaseModel):
    """GET /v1/dataplane: where the gateway's bulk data plane (dataplane.py) listens; the host is
    the one in the gateway's URL."""

    port: int
