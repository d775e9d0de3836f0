"""A named shared-memory segment of KV page slots (a file in /dev/shm, mmapped), with a per-slot
stamp that a reader in another process validates its copy against (a seqlock).

Why: the prefill service's near tier (near_cache.py) lives in these segments when
`kvstore.near.shared_lease_s > 0`, so a decode process on the same host maps them and copies a
prompt's pages host -> device in one DMA (~40-50 GB/s) instead of pulling them through the
gateway's TCP data plane (~0.6-1.7 GB/s measured on the H200 host).

Layout of one segment (all little-endian):
    [0, 4096)            header: magic, 16-byte token, page_bytes, slots
    [4096, data_offset)  slot table: per slot a u64 generation, a u8 key length, 32 key bytes
    [data_offset, end)   slots * page_bytes of page bytes (page aligned)
The writer bumps a slot's generation before it rewrites the slot and again after it has written
the bytes and the key; a reader records (generation, key) at handoff time and checks both before
and after its copy: any rewrite in between changes the generation, so a stale copy is detected and
never used. x86 keeps stores in order and the copy is synchronised before the second check, which
is all the seqlock needs here.

The token (random, in the file and in the handoff) proves a mapped file is the segment the handoff
names and not a stale file of the same name. Names carry the host and the owner's pid, so segments
of a crashed owner on this host are unlinked by the next owner that starts (`sweep_dead`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import mmap
import os
import socket
import struct
import warnings
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "relay-kv-"
MAGIC = b"RELAYKV1"
_HEADER = struct.Struct("<8s16sQQ")  # magic, token, page_bytes, slots
HEADER_BYTES = 4096
KEY_BYTES = 32
_ENTRY = 8 + 1 + KEY_BYTES  # generation, key length, key
ALIGN = 4096


class SegmentUnavailable(Exception):
    """The segment cannot be mapped here (another host, gone, or not the one named)."""


def _host_tag() -> str:
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class SharedSegment:
    """`slots` page slots of `page_bytes` in a /dev/shm file. Create with `create`, map another
    process's with `attach`. `data` is a [slots, page_bytes] uint8 tensor over the mapping."""

    def __init__(self, path: Path, mm: mmap.mmap, token: bytes, page_bytes: int, slots: int, owner: bool):
        self.path, self.name, self.token = path, path.name, token
        self.page_bytes, self.slots, self.owner = page_bytes, slots, owner
        self._mm = mm
        self.table_offset = HEADER_BYTES
        self.data_offset = _round_up(HEADER_BYTES + slots * _ENTRY, ALIGN)
        raw = np.frombuffer(mm, dtype=np.uint8, count=self.data_offset)
        table = raw[self.table_offset : self.table_offset + slots * _ENTRY].reshape(slots, _ENTRY)
        self._gens = table[:, :8].view(np.uint64).reshape(slots)  # one u64 per slot
        self._key_len = table[:, 8]
        self._keys = table[:, 9:]
        with warnings.catch_warnings():  # torch warns that an mmap buffer is not resizable
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mm, dtype=torch.uint8, offset=self.data_offset, count=slots * page_bytes)
        self.data = flat.view(slots, page_bytes)
        self.pinned = False

    @staticmethod
    def segment_bytes(slots: int, page_bytes: int) -> int:
        return _round_up(HEADER_BYTES + slots * _ENTRY, ALIGN) + slots * page_bytes

    @classmethod
    def create(cls, slots: int, page_bytes: int, pin: bool, tag: str = "") -> SharedSegment:
        """A new segment (O_EXCL, its memory reserved up front: on tmpfs an mmap of a file that
        outgrew /dev/shm would SIGBUS on first touch, so a full /dev/shm is an OSError here)."""
        token = os.urandom(16)
        name = f"{PREFIX}{_host_tag()}-{os.getpid()}-{token.hex()[:12]}{tag}"
        path = SHM_DIR / name
        size = cls.segment_bytes(slots, page_bytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        mm[: _HEADER.size] = _HEADER.pack(MAGIC, token, page_bytes, slots)
        seg = cls(path, mm, token, page_bytes, slots, owner=True)
        if pin:
            seg.pin()
        return seg

    @classmethod
    def attach(cls, name: str, token: bytes, page_bytes: int, pin: bool) -> SharedSegment:
        """Map the segment `name` another process created; SegmentUnavailable if it is not here or
        not the one `token` names (another host's segment, or a stale file)."""
        if "/" in name or not name.startswith(PREFIX):
            raise SegmentUnavailable(f"not a relay kv segment name: {name!r}")
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise SegmentUnavailable(f"{name}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise SegmentUnavailable(f"{name}: {size} bytes, not a segment")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, tok, pb, slots = _HEADER.unpack(mm[: _HEADER.size])
        if magic != MAGIC or tok != token or pb != page_bytes or size < cls.segment_bytes(slots, pb):
            mm.close()
            raise SegmentUnavailable(f"{name}: not the segment named (token, page size or length differ)")
        seg = cls(path, mm, token, page_bytes, slots, owner=False)
        if pin:
            seg.pin()
        return seg

    # ------------------------------------------------------------------ pinning

    def pin(self) -> None:
        """Page-lock the mapping for DMA (cudaHostRegister); a failure leaves it pageable (copies
        then go through the driver's staging buffer: slower, still correct)."""
        if not torch.cuda.is_available():
            return
        rc = torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), self.data.numel(), 0)
        if int(rc) != 0:
            log.warning(f"cudaHostRegister of {self.name} failed ({rc}): pageable copies")
            return
        self.pinned = True

    def _unpin(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
            self.pinned = False

    # ------------------------------------------------------------------ stamps

    def begin_write(self, slot: int) -> None:
        """Before rewriting `slot`: any reader's recorded generation no longer matches."""
        self._gens[slot] += np.uint64(1)

    def end_write(self, slot: int, key: bytes) -> None:
        """After `slot` holds the page of `key`."""
        if len(key) > KEY_BYTES:
            raise ValueError(f"key of {len(key)} bytes; at most {KEY_BYTES}")
        self._keys[slot, : len(key)] = np.frombuffer(key, dtype=np.uint8)
        self._key_len[slot] = len(key)
        self._gens[slot] += np.uint64(1)

    def stamp(self, slot: int) -> tuple[int, bytes]:
        """(generation, key) of `slot` as it is now."""
        gen = int(self._gens[slot])
        n = int(self._key_len[slot])
        return gen, self._keys[slot, :n].tobytes()

    def stamps_match(self, slots: np.ndarray, gens: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """stamp(slot) == (gen, key) for many slots at once (keys: [n, key_len] uint8)."""
        width = keys.shape[1]
        if width > self._keys.shape[1]:
            return np.zeros(len(slots), bool)
        same = (self._gens[slots] == gens) & (self._key_len[slots] == width)
        return same & (self._keys[slots, :width] == keys).all(axis=1)

    def generation(self, slot: int) -> int:
        return int(self._gens[slot])

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Unpin and let go of the mapping; the owner also unlinks the file (its memory is freed
        once every process has unmapped it). Idempotent. The mapping is not closed explicitly:
        torch tensors over it (a chunk, a held run still being sent) keep the mmap object alive
        and would dangle if it were unmapped under them; it is unmapped when the last one goes."""
        if self._mm is None:
            return
        self._unpin()
        if self.owner:
            self.path.unlink(missing_ok=True)
        self._mm = None
        del self.data, self._gens, self._key_len, self._keys


def sweep_dead(directory: Path = SHM_DIR) -> int:
    """Unlink this host's segments whose owner process is gone (a prefill killed with SIGKILL
    cannot unlink its own). Returns how many were removed."""
    removed = 0
    mine = f"{PREFIX}{_host_tag()}-"
    for path in directory.glob(f"{mine}*"):
        try:
            pid = int(path.name[len(mine) :].split("-", 1)[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
            continue  # alive (ours or another live owner's)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    if removed:
        log.info(f"removed {removed} kv segments of dead processes from {directory}")
    return removed


def shm_room(directory: Path = SHM_DIR) -> int:
    """Bytes free in `directory` (0 when it does not exist)."""
    try:
        st = os.statvfs(directory)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return 0
        raise
    return st.f_bavail * st.f_frsize
