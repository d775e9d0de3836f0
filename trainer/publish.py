"""Publishing weights: every trainer rank writes its own part of weights/step_N/, in parallel.

`Publisher.publish(model, version, dest, on_done)`:
  1. gather (collective, every rank, in the caller's thread): every parameter has one owner rank
     (`owners`: whole parameters, balanced by size, the same on every rank) and is gathered to that
     rank only: FSDP2's row shards (Shard(0) over every rank) with one `gather` into the owner,
     any other layout with `full_tensor()`. The owner converts it to HF names (the adapter splits
     grouped experts into per-expert tensors), casts it to the engines' dtype, with
     quantization "fp8" stores what an FP8 engine holds in FP8 as (E4M3, 128x128 scales) pairs
     (ops/fp8/checkpoint.is_fp8_weight; the engine copies them without re-quantising),
     and copies it into a reused pinned host buffer. A rank holds its own share on the host and
     one full parameter on the device, never more. The tied output weight is skipped (HF stores
     it once).
  2. write (a background thread on every rank that owns something): its safetensors file into
     the version's temporary directory (services/common/weights_dir.DirWrite: partial name, fsync,
     rename); rank 0 then waits for every rank's file, writes the index, config, tokenizer and
     relay.json, renames the directory into place and calls `on_done(dest)` (the trainer
     announces the version there).
The next step runs while (2) writes. The gather stays in the caller's thread on purpose: its
collectives must not interleave with the next step's FSDP all-gathers on the same process group.
`wait()` joins the write (done before the next gather, a checkpoint, and at exit), so at most one
write is in flight and the buffers are never overwritten while being written.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from ops.fp8.checkpoint import QUANTIZATION_CONFIG, is_fp8_weight
from ops.fp8.recipe import quantize_weight, quantize_weights
from services.common.config import ModelConfig
from services.common.modeldir import hf_config
from services.common.tokenizer import build_char_tokenizer, eos_id, save_tokenizer
from services.common.weights_dir import SCALE_SUFFIX, DirWrite, tokenizer_files
from trainer.master_weights import masters_of
from trainer.param_names import clean_name

PER_EXPERT_INDEX = ".mlp.experts."


@dataclass
class PublishTimes:
    version: int
    wait_s: float  # waiting for the previous version's write to finish (blocks the step loop)
    gather_s: float  # collective gather into host buffers (blocks the step loop)
    write_s: float = 0.0  # background: this rank's file (write + fsync + rename)
    done_s: float = 0.0  # background, rank 0: until the directory is in place and announced
    bytes: int = 0  # this rank's file


def owners(sizes: Iterable[tuple[str, int]], world: int) -> dict[str, int]:
    """Parameter -> the rank that writes it: largest first onto the least-loaded rank (ties: the
    lowest rank), so every rank computes the same plan and the files come out within one
    parameter's size of each other."""
    load = [0] * world
    out: dict[str, int] = {}
    for name, n in sorted(sizes, key=lambda x: -x[1]):
        r = min(range(world), key=lambda i: (load[i], i))
        out[name] = r
        load[r] += n
    return out


def _chunk_rows(n: int, world: int, rank: int) -> int:
    """Rows of a Shard(0) DTensor on `rank`: torch.chunk's split (ceil(n/world) per rank, the
    last ones short or empty), which FSDP2 uses."""
    c = -(-n // world)
    return max(0, min(c, n - rank * c))


class Publisher:
    def __init__(
        self,
        m: ModelConfig,
        rank: int = 0,
        world: int = 1,
        dtype: torch.dtype | None = None,
        quantization: Literal["none", "fp8"] = "none",
        token: str | None = None,
        to_hf: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        """`dtype`, `quantization`: what the engines serve (floating tensors are cast on the device
        before the copy to the host, so a bf16 fleet gets half the bytes of the float32 masters,
        an FP8 one about a quarter). `token`: names the version's temporary directory; every rank
        must pass the same one (the trainer broadcasts rank 0's). `to_hf`: the model's names to
        HF's, one parameter at a time (default: trainer.model.adapter's)."""
        self.m = m
        self.rank, self.world = rank, world
        self.dtype = dtype
        self.fp8 = quantization == "fp8"
        self.token = token or str(os.getpid())
        if to_hf is None:
            from trainer.model import adapter  # torchtitan: imported only when used

            to_hf = adapter(m).to_hf
        self._to_hf_names = to_hf
        self._owners: dict[str, int] | None = None
        self._files: dict[int, int] = {}  # rank -> its file's index
        self._buffers: dict[str, torch.Tensor] = {}  # HF name -> host buffer, reused
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: PublishTimes | None = None  # the most recent completed publish
        self._config: dict[str, Any] = {}
        self._extra: dict[str, bytes] = {}
        if rank == 0:
            self._config, self._extra = self._metadata()

    def _metadata(self) -> tuple[dict[str, Any], dict[str, bytes]]:
        """config.json and the tokenizer files (trainer.model.save_weights_dir writes the same)."""
        tok = build_char_tokenizer()
        if tok.get_vocab_size() > self.m.vocab_size:
            raise ValueError(
                f"tokenizer has {tok.get_vocab_size()} tokens > model vocab_size {self.m.vocab_size}"
            )
        config = hf_config(self.m, eos_id(tok))
        if self.fp8:
            config["quantization_config"] = dict(QUANTIZATION_CONFIG)
        with tempfile.TemporaryDirectory() as tdir:
            save_tokenizer(tok, Path(tdir), self.m.chat_template)
            return config, tokenizer_files(Path(tdir))

    # ------------------------------------------------------------------ gather

    def _state(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        # With master weights (trainer.fsdp = "master") the float32 masters, not their bf16 copy:
        # an engine in float32 gets the exact weights; cast to bf16 they equal the parameters.
        mw = masters_of(model)
        sd = mw.state_dict(model) if mw is not None else model.state_dict()
        items = [(clean_name(k), t) for k, t in sd.items()]
        # The same parameter as tok_embeddings.weight; HF stores it once.
        return [(k, t) for k, t in items if not (k == "output.weight" and self.m.tie_embeddings)]

    def _plan(self, items: list[tuple[str, torch.Tensor]]) -> dict[str, int]:
        if self._owners is None:
            self._owners = owners(((k, t.numel() * t.element_size()) for k, t in items), self.world)
            ranks = sorted(set(self._owners.values()))
            self._files = {r: i for i, r in enumerate(ranks)}
        return self._owners

    def _gather_to(self, t: torch.Tensor, owner: int) -> torch.Tensor | None:
        """The full tensor on `owner`, None elsewhere. Collective for a sharded DTensor."""
        from torch.distributed.tensor import DTensor

        if not isinstance(t, DTensor):
            return t if self.rank == owner else None
        placements = t.placements
        if all(p.is_replicate() for p in placements):
            return t.to_local() if self.rank == owner else None
        mesh = t.device_mesh
        group = mesh.get_group() if mesh.ndim == 1 else None
        if (
            group is not None
            and placements[0].is_shard(0)
            and dist.get_process_group_ranks(group) == list(range(self.world))
        ):
            return self._gather_rows(t.to_local(), tuple(t.shape), owner, group)
        full = t.full_tensor()
        return full if self.rank == owner else None

    def _gather_rows(
        self, local: torch.Tensor, shape: tuple[int, ...], owner: int, group: dist.ProcessGroup
    ) -> torch.Tensor | None:
        """FSDP2's Shard(0) pieces gathered into `owner` only: each rank sends its rows (padded to
        the common chunk) once, so a step's publish moves each parameter's bytes once in total
        instead of world times as an all-gather would."""
        n, w = shape[0], self.world
        c = -(-n // w)
        rows = _chunk_rows(n, w, self.rank)
        if local.shape[0] != rows:
            raise RuntimeError(
                f"a Shard(0) piece of {rows} rows expected on rank {self.rank}, got {local.shape[0]}"
            )
        send = local.contiguous()
        if rows != c:
            send = torch.zeros((c, *shape[1:]), dtype=local.dtype, device=local.device)
            send[:rows].copy_(local)
        if self.rank != owner:
            dist.gather(send, None, dst=owner, group=group)
            return None
        out = torch.empty((c * w, *shape[1:]), dtype=local.dtype, device=local.device)
        dist.gather(send, list(out.chunk(w)), dst=owner, group=group)
        return out[:n]

    def _to_hf(self, name: str, full: torch.Tensor) -> dict[str, torch.Tensor]:
        """One full parameter as the HF tensors the engines load: names from the adapter (names it
        does not map, MoE bookkeeping buffers, give {} and are not published), cast, and with fp8
        the FP8 engine's (weight, scale) pairs."""
        full = full.detach()
        if self.dtype is not None and full.is_floating_point() and full.dtype != self.dtype:
            full = full.to(self.dtype)
        hf = self._to_hf_names({name: full})
        if not self.fp8 or not any(is_fp8_weight(k, v.shape) for k, v in hf.items()):
            return hf
        out: dict[str, torch.Tensor] = {}
        stacked = quantize_weights(full) if full.dim() == 3 else None  # grouped experts, one call
        for k, v in hf.items():
            if not is_fp8_weight(k, v.shape):
                out[k] = v
                continue
            e = int(k.split(PER_EXPERT_INDEX)[1].split(".")[0]) if PER_EXPERT_INDEX in k else -1
            if stacked is not None and e >= 0 and stacked[0][e].shape == v.shape:
                q, s = stacked[0][e], stacked[1][e]
            else:
                q, s = quantize_weight(v)
            out[k], out[k + SCALE_SUFFIX] = q, s
        return out

    def gather(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Collective: this rank's HF tensors, in host buffers (the parameters it owns)."""
        items = self._state(model)
        plan = self._plan(items)
        out: dict[str, torch.Tensor] = {}
        cuda = False
        for name, t in items:
            full = self._gather_to(t, plan[name])
            if full is None:
                continue
            for hf_name, v in self._to_hf(name, full).items():
                buf = self._buffers.get(hf_name)
                if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
                    buf = torch.empty(v.shape, dtype=v.dtype, pin_memory=v.device.type == "cuda")
                    self._buffers[hf_name] = buf
                cuda = cuda or v.device.type == "cuda"
                buf.copy_(v, non_blocking=True)
                out[hf_name] = buf
            del full
        if cuda:
            torch.cuda.synchronize()
        return out

    # ------------------------------------------------------------------ publish

    def publish(
        self,
        model: nn.Module,
        version: int,
        dest: Path,
        on_done: Callable[[Path], None] | None = None,
        background: bool = True,
        meta: dict[str, Any] | None = None,
    ) -> float:
        """Gather now (collective), write `dest` in the background (every rank its file, rank 0
        the rest; `meta` joins relay.json). Returns the seconds the caller was blocked (the
        previous write + the gather)."""
        t0 = time.monotonic()
        self.wait()
        t_gather = time.monotonic()
        state = self.gather(model)
        times = PublishTimes(version=version, wait_s=t_gather - t0, gather_s=time.monotonic() - t_gather)
        write = DirWrite(Path(dest), self.token, len(self._files))
        mine = self._files.get(self.rank)
        meta = {**(meta or {}), "version": version, "step": version, "files": len(self._files)}

        def work() -> None:
            t1 = time.monotonic()
            try:
                if mine is not None:
                    times.bytes = write.write_file(mine, state)
                    times.write_s = time.monotonic() - t1
                if self.rank == 0:
                    write.finish(self._config, self._extra, meta)
                    if on_done is not None:
                        on_done(write.dest)
                    times.done_s = time.monotonic() - t1
                self.last = times
            except BaseException as e:  # re-raised by wait() in the training thread
                if self.rank == 0:
                    write.abandon()
                self._error = e

        if background:
            self._thread = threading.Thread(target=work, name=f"publish-{version}", daemon=True)
            self._thread.start()
        else:
            work()
            self._raise()
        return time.monotonic() - t0

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("publishing weights failed") from err
