"""Publishing weights fast: per-parameter gather, then a background write of weights/step_N/.

`Publisher.publish(model, version, ...)`:
  1. gather (collective, every rank, in the caller's thread): for each parameter in state-dict
     order, `DTensor.full_tensor()` (an all-gather of that one tensor), and rank 0 copies it into
     a reused pinned CPU buffer. No rank ever holds a full model copy on the device; the peak is
     one full parameter. The tied output weight is skipped (HF stores it once).
  2. write (rank 0, a background thread): the HF directory with the same contract as
     services/common/modeldir.write_model_dir (temporary name, fsync, rename), with
     model.safetensors streamed tensor by tensor from the buffers (safetensors' save_file would
     first copy every tensor into a Python bytes object while holding the GIL, stalling the
     training thread), then `on_done(dest)` (the trainer sets weights:latest there).
The next step runs while (2) writes. The gather stays in the caller's thread on purpose: its
collectives must not interleave with the next step's FSDP all-gathers on the same process group.
`wait()` joins the write (done before the next gather, a checkpoint, and at exit), so at most one
write is in flight and the buffers are never overwritten while being written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from services.common.config import ModelConfig
from services.common.modeldir import WEIGHTS_FILE, hf_config
from services.common.tokenizer import build_char_tokenizer, eos_id, save_tokenizer
from trainer.master_weights import masters_of
from trainer.model import adapter
from trainer.param_names import clean_name

# safetensors dtype names
_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass
class PublishTimes:
    version: int
    wait_s: float  # waiting for the previous version's write to finish (blocks the step loop)
    gather_s: float  # collective gather into host buffers (blocks the step loop)
    write_s: float = 0.0  # background: file write + fsync + rename (+ on_done)
    bytes: int = 0


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Stream `tensors` (CPU, contiguous) into a safetensors file; returns the bytes written."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format wants the data 8-byte aligned
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for t in tensors.values():
            if t.numel():
                # file.write releases the GIL for the copy into the kernel; no bytes() copy.
                fh.write(t.reshape(-1).view(torch.uint8).numpy().data)
        fh.flush()
        os.fsync(fh.fileno())
    return 8 + len(raw) + offset


def write_weights_dir(
    m: ModelConfig, hf_state: dict[str, torch.Tensor], dest: Path, meta: dict[str, Any]
) -> int:
    """modeldir.write_model_dir's contract (tmp dir, fsync, rename) with a streamed weights file;
    the same tokenizer and config as trainer.model.save_weights_dir."""
    tok = build_char_tokenizer()
    if tok.get_vocab_size() > m.vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens > model vocab_size {m.vocab_size}")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    n = write_safetensors(tmp / WEIGHTS_FILE, hf_state, {"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf_config(m, eos_id(tok)), indent=2))
    with tempfile.TemporaryDirectory() as tdir:
        save_tokenizer(tok, Path(tdir), m.chat_template)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (Path(tdir) / name).exists():
                shutil.copy2(Path(tdir) / name, tmp / name)
    (tmp / "relay.json").write_text(json.dumps({**meta, "created": time.time()}, indent=2))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if dest.exists():
        shutil.rmtree(dest)
    os.rename(tmp, dest)
    return n


class Publisher:
    def __init__(self, m: ModelConfig, is_main: bool, dtype: torch.dtype | None = None) -> None:
        self.m = m
        self.is_main = is_main
        # The engines' dtype: floating tensors are cast on the device before the copy to the host,
        # so a bf16 fleet gets half the bytes (gather, D2H and the write) of the float32 masters.
        self.dtype = dtype
        self._adapter = adapter(m)
        self._buffers: dict[str, torch.Tensor] = {}  # HF name -> host buffer, reused
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: PublishTimes | None = None  # the most recent completed publish

    def gather(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Collective: full HF-named CPU tensors on rank 0 ({} elsewhere), one parameter at a time."""
        from torch.distributed.tensor import DTensor

        out: dict[str, torch.Tensor] = {}
        cuda = False
        # With master weights (trainer.fsdp = "master") the float32 masters, not their bf16 copy:
        # an engine in float32 gets the exact weights; cast to bf16 they equal the parameters.
        mw = masters_of(model)
        for name, t in (mw.state_dict(model) if mw is not None else model.state_dict()).items():
            name = clean_name(name)
            if name == "output.weight" and self.m.tie_embeddings:
                continue  # the same parameter as tok_embeddings.weight; HF stores it once
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if self.is_main:
                # Converted after the gather: the adapter splits a full grouped-experts tensor
                # into HF's per-expert tensors (several names for one parameter); names it does
                # not map (MoE bookkeeping buffers) give {} and are not published, as today.
                for hf_name, v in self._adapter.to_hf({name: full.detach()}).items():
                    if self.dtype is not None and v.is_floating_point() and v.dtype != self.dtype:
                        v = v.to(self.dtype)
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

    def publish(
        self,
        model: nn.Module,
        version: int,
        dest: Path,
        on_done: Callable[[Path], None] | None = None,
        background: bool = True,
    ) -> float:
        """Gather now (collective), write `dest` in the background on rank 0. Returns the
        seconds the caller was blocked (waiting for the previous write + the gather)."""
        t0 = time.monotonic()
        self.wait()
        t_gather = time.monotonic()
        state = self.gather(model)
        times = PublishTimes(version=version, wait_s=t_gather - t0, gather_s=time.monotonic() - t_gather)
        if self.is_main:
            meta = {"version": version, "step": version}

            def write() -> None:
                t1 = time.monotonic()
                try:
                    times.bytes = write_weights_dir(self.m, state, dest, meta)
                    if on_done is not None:
                        on_done(dest)
                    times.write_s = time.monotonic() - t1
                    self.last = times
                except BaseException as e:  # re-raised by wait() in the training thread
                    self._error = e

            if background:
                self._thread = threading.Thread(target=write, name=f"publish-{version}", daemon=True)
                self._thread.start()
            else:
                write()
                self._raise()
        else:
            self.last = times
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
