"""The relay trainer: reads rollout groups from Redis, trains one step per batch, publishes weights.

    python -m trainer --config RUN_DIR/config.json --redis-url URL --run-dir RUN_DIR
    torchrun --standalone --nproc_per_node=2 -m trainer ...   (same flags; see trainer/launch.py)

One code path for 1 and N processes: under torchrun a gloo process group is initialised and the
model is sharded with FSDP2; without it the collectives below are no-ops. Rank 0 alone talks to
Redis and the weights directory; it broadcasts each batch to the other ranks.

Step protocol (trainer holds version v):
  1. collect: read groups until `orchestrator.batch_size` eligible ones; a group with staleness
     v - min_version > max_off_policy_steps is acked + marked dropped at once.
  2. compute: loss over the step (docs/loss.md), clip, AdamW step -> version v+1.
  3. commit: gather weights/step_{v+1} (written atomically and published by a background
     thread, docs/trainer.md), mark the groups trained, record the trainer state, THEN ack their
     stream entries (at-least-once: a crash before the ack leaves them pending; the restarted
     trainer re-reads them and skips those already in the ledger).
  4. every trainer.checkpoint_every steps (and at the last step / a graceful stop): checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import redis
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from services.common.bus import Bus, until_done
from services.common.config import RunConfig, load_resolved
from services.common.disk import FATAL_EXIT, disk_full, fallback_log_dir, move_stdio
from services.common.gpu_memory import cap_process_memory, memory_held
from services.common.schemas import RolloutGroup, TrainerStepMetrics, WeightsInfo
from services.common.service import log_event, setup_logging
from services.common.weights_dir import newest_version, read_meta, remove_temp_dirs, retain, step_dir
from services.common.weights_gate import AnnouncedVersions
from trainer.attention import micro_batch_attention, packed_logprobs  # perf path
from trainer.batch import (
    MicroBatch,
    flatten,
    loss_token_count,
    micro_batches,
    split_for_ranks,
    to_device,
    truncate,
)
from trainer.chunked import enable_chunked_output
from trainer.entropy import EntropyControl
from trainer.glm5 import glm_attentions, indexer_loss, set_indexer_mode
from trainer.loss import ratio_loss
from trainer.master_weights import masters_of, optimizer_params, sync_params
from trainer.mismatch import micro_batch_versions
from trainer.model import build_model, load_weights_dir, moe_layer_ids
from trainer.packing import PackedMicroBatch, packed_micro_batches
from trainer.parallel import (
    Degrees,
    autocast_context,
    clip_grad_norm,
    cp_dummy_inputs,
    cp_micro_batch,
    parallelize,
)
from trainer.publish import Publisher  # perf path
from trainer.replay import enable_router_replay, micro_batch_routes, replay_at, routing
from trainer.step_stats import StepStats

CONSUMER = "trainer"
CKPT_RE = re.compile(r"^step_(\d+)$")
CKPT_FILE = "state.pt"
KEEP_CHECKPOINTS = 2
READ_BLOCK_MS = 500
# Non-zero ranks sit in a broadcast while rank 0 waits for rollouts, which can take long
# (slow orchestrator, paused run). If rank 0 dies, torchrun tears the others down anyway.
DIST_TIMEOUT = timedelta(hours=24)
T = TypeVar("T")


# ------------------------------------------------------------------ distributed helpers


class Dist:
    """The process group, or a stand-in of world size 1 when not launched by torchrun."""

    def __init__(self, device: str = "cpu") -> None:
        self.enabled = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if use_cuda:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if self.enabled and not dist.is_initialized():
            backend = "nccl" if use_cuda else "gloo"
            dist.init_process_group(
                backend, timeout=DIST_TIMEOUT, device_id=self.device if use_cuda else None
            )
        self.rank = dist.get_rank() if self.enabled else 0
        self.world = dist.get_world_size() if self.enabled else 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any) -> Any:
        if not self.enabled:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """All-reduce a small CPU tensor (through the device when the backend needs it)."""
        if self.enabled:
            dev = t.to(self.device)
            dist.all_reduce(dev, op=op)
            t = dev.cpu()
        return t

    def all_reduce_(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """All-reduce `t` (on this rank's device) in place, with no host copy; returns it."""
        if self.enabled:
            dist.all_reduce(t, op=op)
        return t

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def _local(x: torch.Tensor) -> torch.Tensor:
    """A DTensor (the gradient norm under FSDP2) as a plain tensor, still on the device: a
    collective, no host copy."""
    full = getattr(x, "full_tensor", None)
    return full() if callable(full) else x  # type: ignore[no-any-return]


# ------------------------------------------------------------------ checkpoints


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint. Complete = renamed into place (only done after its file
    was fully written and fsynced), so any step_N dir with state.pt is whole."""
    root = run_dir / "checkpoints"
    best: tuple[int, Path] | None = None
    if root.is_dir():
        for p in root.iterdir():
            m = CKPT_RE.match(p.name)
            if m and (p / CKPT_FILE).is_file() and (best is None or int(m.group(1)) > best[0]):
                best = (int(m.group(1)), p)
    return best


def remove_partial_writes(run_dir: Path) -> list[str]:
    """The temporary directories of weights and checkpoint writes that never completed
    (`.step_N.tmp-<pid>`, left by a failed write or a killed process): only the trainer writes
    them, and a finished write has renamed its directory, so any found at start or after a
    failed write are garbage."""
    removed = [str(p) for p in remove_temp_dirs(run_dir)]  # weights: their format's own names
    root = run_dir / "checkpoints"
    for p in root.glob(".step_*.tmp-*") if root.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(str(p))
    return removed


def write_checkpoint(run_dir: Path, step: int, payload: dict[str, Any]) -> Path:
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    dest = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    with open(tmp / CKPT_FILE, "wb") as fh:
        torch.save(payload, fh)
        fh.flush()
        os.fsync(fh.fileno())
    if dest.exists():
        shutil.rmtree(dest)
    os.rename(tmp, dest)
    # Keep the newest few: one older than the latest covers a corrupt newest file.
    steps = sorted(
        int(m.group(1)) for p in root.iterdir() if (m := CKPT_RE.match(p.name)) and (p / CKPT_FILE).is_file()
    )
    for old in steps[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(root / f"step_{old}", ignore_errors=True)
    return dest


# ------------------------------------------------------------------ the trainer


@dataclass
class Batch:
    """What rank 0 broadcasts each step: the groups to train, or stop=True."""

    stop: bool
    groups: list[RolloutGroup]
    dropped_stale: int = 0
    wait_s: float = 0.0


@dataclass
class StepResult:
    loss: float
    entropy: float
    grad_norm: float
    masked_ratio_frac: float
    loss_tokens: int
    tokens: int
    compute_s: float
    entropy_coef: float = 0.0  # the bonus's coefficient this step used
    # trainer/inference mismatch (trainer.mismatch.MismatchStats.summary), TrainerStepMetrics fields
    mismatch: dict[str, Any] = field(default_factory=dict)
    dsa_indexer_kl: float | None = None  # GLM-5, trainer.dsa_indexer = "kl"


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        redis_url: str,
        d: Dist | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.d = d or Dist(cfg.trainer.device)
        self.log = log or logging.getLogger("trainer")
        self.bus = Bus(redis_url, cfg.redis.prefix) if self.d.is_main else None
        self.announced = AnnouncedVersions(self.bus) if self.bus is not None else None
        self.stop_requested = threading.Event()
        self.version = 0
        self.last_checkpoint = -1
        self.backlog: list[tuple[str, RolloutGroup]] = []
        self.model: nn.Module
        self.opt: torch.optim.Optimizer
        # perf path: set by setup()
        self.degrees: Degrees
        self.meshes: dict[str, Any] = {}
        # Every rank writes its share of each version, in what the engines serve (trainer/publish.py).
        self.publisher = Publisher(
            cfg.model,
            self.d.rank,
            self.d.world,
            getattr(torch, cfg.decode.engine.dtype),
            cfg.decode.engine.quantization,
            token=str(self.d.broadcast(os.getpid())),
        )
        tc = cfg.trainer
        self.entropy = EntropyControl(
            tc.entropy_coef, tc.entropy_target, tc.entropy_coef_lr, tc.entropy_coef_max
        )

    # -------------------------------------------------------------- setup / resume

    def setup(self) -> None:
        tc = self.cfg.trainer
        torch.set_num_threads(tc.torch_threads)
        # Before the model reaches the device: a trainer sharing its GPU with decode stays in its budget.
        memory_cap = cap_process_memory(self.d.device, tc.cuda_memory_gib)
        model = build_model(self.cfg.model, seed=self.cfg.run.seed, init_std=tc.init_std)
        if self.d.is_main:
            remove_partial_writes(self.run_dir)
        ckpt = latest_checkpoint(self.run_dir)
        state: dict[str, Any] | None = None
        if ckpt is not None:
            # Every rank reads the full checkpoint (shared filesystem assumed, as for weights/).
            state = torch.load(ckpt[1] / CKPT_FILE, map_location="cpu", weights_only=True)
            model.load_state_dict(state["model"])
            self.version = self.last_checkpoint = int(state["step"])
        elif (
            step_dir(self.run_dir, 0).exists()
            and read_meta(step_dir(self.run_dir, 0)).get("init") != self._init
        ):
            # Weights placed there to start from (not this run's own seeded init, which the model
            # already is, exactly: the published copy is in the engines' precision).
            _, sd = load_weights_dir(step_dir(self.run_dir, 0))
            model.load_state_dict(sd)
            self.version = 0
        # else: fresh run (or restarted before its first checkpoint); every rank built the same
        # seeded init, which is written as step_0 below unless it is there.
        # Both swaps keep parameters and names; they only act when packing / chunking is used.
        # float32 logits as the engine's (docs/replay.md); head_cache_gib: no logits GEMM in the
        # head's backward when its probabilities fit (docs/trainer.md)
        enable_chunked_output(model, tc.logits_fp32, tc.head_cache_gib)
        enable_router_replay(model)  # MoE: routers that can follow recorded expert ids
        set_indexer_mode(model, tc.dsa_indexer)  # GLM-5's DSA indexer: frozen or KL-trained
        if tc.fp8:
            # Same FP8 recipe as an engine with quantization="fp8"; master weights stay as they are.
            from trainer.fp8 import Fp8BlockwiseConverter

            Fp8BlockwiseConverter(
                fp8_dgrad=tc.fp8_backward, fp8_wgrad=tc.fp8_backward, min_weights=tc.fp8_min_weights
            ).convert(model)
        # --- perf path: attention kernel (document masking), cp, AC, compile, FSDP2
        # with mixed precision, per trainer.* (trainer/parallel.py; docs/trainer.md)
        self.model, self.degrees, self.meshes = parallelize(
            model.to(self.d.device), tc, self.d.world, self.d.device, self.d.enabled
        )
        # --- end perf path
        # Fused on CUDA (one kernel per parameter group instead of foreach's several passes;
        # measured faster on the H200), torch's default elsewhere.
        self.opt = torch.optim.AdamW(
            optimizer_params(self.model),  # trainer.fsdp = "master": the float32 masters
            lr=tc.lr,
            betas=tc.betas,
            weight_decay=tc.weight_decay,
            fused=True if self.d.device.type == "cuda" else None,
        )
        if state is not None:
            if (mw := masters_of(self.model)) is not None:  # keyed by name, as below
                mw.load_optimizer_state_dict(self.opt, state["optimizer"])
            else:
                set_optimizer_state_dict(
                    self.model, self.opt, state["optimizer"], options=StateDictOptions(full_state_dict=True)
                )
            # The checkpoint restores Adam's moments; the hyper-parameters come from the config,
            # so a restart with a changed lr/betas/weight_decay takes effect.
            for group in self.opt.param_groups:
                group.update(lr=tc.lr, betas=tc.betas, weight_decay=tc.weight_decay)
            self.entropy.load_state_dict(state.get("entropy") or {})
            rng = state.get("rng") or []
            if len(rng) == self.d.world:
                torch.set_rng_state(rng[self.d.rank])

        # Publish the version we hold. On a resume the checkpoint may be OLDER than the newest
        # version the previous process reached, M: weights:latest (a crash after publishing step
        # M but before checkpointing it), its recorded state (a crash after committing step M,
        # its metrics pushed, while its weights were still being written in the background, so
        # weights:latest is one behind), or the newest weights directory on disk (written but
        # unpublished, or published while Redis lost its last second of writes). The updates
        # after the checkpoint are lost, and we publish the checkpoint's model as version M+1:
        # a version number names one set of weights for the whole run, never reused for other
        # weights and never lower than one already served, and no weights directory is rewritten
        # (docs/loss.md). Rank 0 decides (another rank could see a directory appear mid-write and
        # skip the collective inside _write_weights).
        latest = self._redis("resume", self.bus.latest_weights) if self.bus is not None else None
        reached = max(
            latest.version if latest is not None else -1,
            self._recorded_version(),
            newest_version(self.run_dir) if self.d.is_main else -1,
        )
        if reached > self.version:  # also without a checkpoint: the seeded init, numbered on
            self.version = reached + 1
        self.version = int(self.d.broadcast(self.version))
        if self.d.broadcast(not step_dir(self.run_dir, self.version).exists()):
            self._write_weights(self.version)
        if self.bus is not None:
            bus = self.bus
            info = WeightsInfo(version=self.version, path=str(step_dir(self.run_dir, self.version)))
            self._redis("setup", bus.ensure_trainer_group)
            self._redis("publish", bus.publish_weights, info)
            self._recover_pending()
            self._record_state("running")
        log_event(
            self.log,
            "trainer ready",
            version=self.version,
            resumed_from=str(ckpt[1]) if ckpt else None,
            rank=self.d.rank,
            world=self.d.world,
            backlog=len(self.backlog),
            **memory_cap,
        )

    def on_disk_full(self, e: BaseException) -> None:
        """Rank 0: remove what the failed write left, and say so where it can be read (Redis, and
        the log: the launcher prints "disk full" from the trainer state)."""
        if not self.d.is_main:
            return
        removed = remove_partial_writes(self.run_dir)
        free = shutil.disk_usage(self.run_dir).free
        # Our log is on the full disk too: what follows goes where it can be written.
        moved = fallback_log_dir(self.cfg.redis.prefix) / "trainer.log"
        log_event(
            self.log,
            "disk full",
            error=repr(e),
            free_bytes=free,
            removed=removed,
            version=self.version,
            log=str(moved) if move_stdio(moved) else "",
        )
        if (bus := self.bus) is not None:
            with contextlib.suppress(redis.RedisError):
                state = {**self._state("disk full"), "error": f"{e!r}: {e.__cause__!r}"}
                bus.r.hset(bus.k.trainer_state, mapping=state)

    def _redis(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Rank 0's Redis calls: retried however long Redis is away (a restart under the run),
        never a crash; a stop request ends the wait."""
        return until_done(lambda: fn(*args, **kwargs), what, stop=self.stop_requested.is_set)

    def _recover_pending(self) -> None:
        """Entries delivered to this consumer but never acked, not yet in the backlog: the previous
        process died before committing, or a read's reply was lost while Redis restarted (the
        entries were delivered but never reached us). Trained ones are acked and skipped."""
        bus = self.bus
        assert bus is not None
        pending = self._redis("recover", bus.read_groups, CONSUMER, count=1_000_000, block_ms=0, pending=True)
        known = {eid for eid, _ in self.backlog}
        new = [(eid, g) for eid, g in pending if eid not in known]
        done = {eid for eid, g in new if self._redis("recover", bus.is_trained, g.group_id)}
        self._redis("recover", bus.ack, sorted(done))
        self.backlog += [(eid, g) for eid, g in new if eid not in done]

    # -------------------------------------------------------------- weights / state

    def _full_state(self) -> dict[str, torch.Tensor]:
        # Collective under FSDP2: every rank must call it; rank 0 gets full CPU tensors.
        if (mw := masters_of(self.model)) is not None:
            return mw.full_state_dict(self.model)  # the float32 masters, not their bf16 copy
        return get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    @property
    def _init(self) -> dict[str, Any]:
        """What a fresh run's weights are (relay.json of its step_0): build_model's seeded init."""
        return {"seed": self.cfg.run.seed, "init_std": self.cfg.trainer.init_std}

    def _write_weights(self, version: int) -> Path:
        """Collective: write `version` now (every rank its share), e.g. the seeded init as step_0."""
        dest = step_dir(self.run_dir, version)
        meta = {"init": self._init} if version == 0 and self.last_checkpoint < 0 else {}
        self.publisher.publish(self.model, version, dest, background=False, meta=meta)
        return dest

    def _announce(self, dest: Path) -> None:
        """Called by rank 0's publishing thread once `dest` is renamed into place: the version is
        announced (the only versions services load and samples may carry), then old ones go."""
        if self.bus is not None:
            bus, info = self.bus, WeightsInfo(version=int(dest.name.split("_")[1]), path=str(dest))
            self._redis("publish", bus.publish_weights, info)
            self._retain()

    def _retain(self) -> None:
        """run.keep_weights: keep the newest versions, every M-th, what a live service serves and
        what a restart needs (the latest checkpoint's step; without one, a step_0 that is not this
        run's seeded init, which a restart loads)."""
        assert self.bus is not None
        kw = self.cfg.run.keep_weights
        try:
            served = {s.version for s in self.bus.services() if s.version >= 0}
        except redis.RedisError as e:  # unknown who serves what: delete nothing this time
            log_event(self.log, "weights retention skipped", error=str(e))
            return
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is not None:
            needed = {ckpt[0]}
        else:
            needed = {0} if read_meta(step_dir(self.run_dir, 0)).get("init") != self._init else set()
        gone = retain(self.run_dir, kw.last, kw.every, served | needed)
        log_event(self.log, "weights retained", deleted=gone, served=sorted(served), needed=sorted(needed))

    def _checkpoint(self) -> None:
        """All ranks gather; rank 0 writes one full checkpoint (model, optimizer keyed by
        parameter name, per-rank RNG), so it reloads under any world size."""
        model_sd = self._full_state()
        if (mw := masters_of(self.model)) is not None:  # one rank: the optimizer state by name
            optim_sd = mw.optimizer_state_dict(self.opt)
        else:
            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            optim_sd = get_optimizer_state_dict(self.model, self.opt, options=opts)
        rng = self.d.all_gather(torch.get_rng_state())
        if self.d.is_main:
            payload = {
                "format": 1,
                "step": self.version,
                "version": self.version,
                "model": model_sd,
                "optimizer": optim_sd,
                "rng": rng,
                "entropy": self.entropy.state_dict(),
                "world": self.d.world,
                "time": time.time(),
            }
            path = write_checkpoint(self.run_dir, self.version, payload)
            log_event(self.log, "checkpoint", step=self.version, path=str(path))
        self.last_checkpoint = self.version
        self.d.barrier()

    def _recorded_version(self) -> int:
        """The version in the trainer state a previous process of this run recorded (-1: none)."""
        bus = self.bus
        if bus is None:
            return -1
        raw = self._redis("resume", bus.r.hget, bus.k.trainer_state, "version")
        return int(raw) if raw is not None else -1

    def _state(self, status: str) -> dict[str, Any]:
        return {
            "version": self.version,
            "step": self.version,
            "last_checkpoint": self.last_checkpoint,
            "status": status,
            "world": self.d.world,
            "pid": os.getpid(),
            "updated": time.time(),
        }

    def _record_state(self, status: str) -> None:
        bus = self.bus
        if bus is not None:
            self._redis("state", bus.r.hset, bus.k.trainer_state, mapping=self._state(status))

    # -------------------------------------------------------------- data

    def _should_stop(self) -> bool:
        if self.stop_requested.is_set():
            return True
        bus = self.bus
        assert bus is not None
        try:
            return bool(self._redis("stop key", bus.r.exists, bus.k.control_stop))
        except redis.RedisError:
            return self.stop_requested.is_set()  # a stop request ended the wait

    def _collect(self) -> tuple[Batch, list[str]]:
        """Rank 0: gather exactly batch_size eligible groups. Returns the batch and the stream
        entry ids to ack once it is committed. On stop the partial batch stays unacked."""
        bus = self.bus
        assert bus is not None
        oc = self.cfg.orchestrator
        if self._redis("collect", bus.pending_count, CONSUMER) > len(self.backlog):
            self._recover_pending()
        picked: list[tuple[str, RolloutGroup]] = []
        seen: set[str] = set()
        dropped = 0
        t0 = time.monotonic()
        while len(picked) < oc.batch_size:
            if self._should_stop():
                return Batch(stop=True, groups=[]), []
            need = oc.batch_size - len(picked)
            if self.backlog:
                entries, self.backlog = self.backlog[:need], self.backlog[need:]
            else:
                entries = self._redis(
                    "collect", bus.read_groups, CONSUMER, count=need, block_ms=READ_BLOCK_MS
                )
            for eid, g in entries:
                if g.group_id in seen or self._redis("collect", bus.is_trained, g.group_id):
                    self._redis("collect", bus.ack, [eid])  # delivered again: already trained
                    continue
                if g.min_version < 0:
                    self._drop(eid, g, "empty: no loss tokens")
                    continue
                assert self.announced is not None
                versions = [v for s in g.samples for v in s.all_versions()]
                # Retried like every other Redis call here: an outage during the check must not
                # end the trainer, and the drop is one atomic ledger write + ack (never acked
                # without being recorded).
                bad = self._redis("announced versions", self.announced.unannounced, versions)
                if bad:  # generated by weights this run's trainer never published
                    self._drop(eid, g, f"unannounced: weight versions {bad}")
                    continue
                staleness = self.version - g.min_version
                if staleness > oc.max_off_policy_steps:
                    self._drop(
                        eid,
                        g,
                        f"stale: trainer v{self.version} - min_version {g.min_version} = {staleness}"
                        f" > max_off_policy_steps {oc.max_off_policy_steps}",
                    )
                    dropped += 1
                    continue
                picked.append((eid, g))
                seen.add(g.group_id)
        batch = Batch(
            stop=False, groups=[g for _, g in picked], dropped_stale=dropped, wait_s=time.monotonic() - t0
        )
        return batch, [eid for eid, _ in picked]

    def _drop(self, eid: str, g: RolloutGroup, reason: str) -> None:
        bus = self.bus
        assert bus is not None
        self._redis("drop", bus.drop_entry, eid, g.group_id, reason, self.version)

    # -------------------------------------------------------------- compute

    def train_step(self, groups: list[RolloutGroup]) -> StepResult:
        """One optimizer step on `groups` (the full batch; every rank gets the same list and
        trains its own share). Collective: all ranks call it together."""
        t0 = time.monotonic()
        tc = self.cfg.trainer
        samples = [truncate(s, self.cfg.model.max_seq_len + 1) for s in flatten(groups)]
        # perf path: ranks of one cp group train the same samples (each its sequence shard).
        deg = self.degrees
        mine = split_for_ranks(samples, deg.dp)[deg.data_rank(self.d.rank)]
        mbs: list[MicroBatch] | list[PackedMicroBatch]
        if tc.packing:
            mbs = packed_micro_batches(mine, tc.micro_batch_tokens)
        else:
            mbs = micro_batches(mine, tc.micro_batch_tokens)
        # MoE: the engine's expert ids per micro-batch (replayed, and compared for the metrics)
        routes = micro_batch_routes(mine, self.cfg.model, tc.packing, tc.micro_batch_tokens)
        if deg.cp > 1:  # a CP shard would need its routing sharded the same way: not wired
            if self.cfg.model.is_moe and tc.router_replay:
                raise ValueError(
                    "trainer.router_replay needs trainer.cp = 1 (CP-sharded routing is not supported)"
                )
            routes = [None] * len(routes)
        # Samples' min versions, for the on-policy mismatch (a CP shard is not aligned with them).
        versions = micro_batch_versions(mine, tc.packing, tc.micro_batch_tokens) if deg.cp == 1 else None
        # The normaliser is the step's loss-token count summed over all ranks.
        counts = self.d.all_reduce(torch.tensor([loss_token_count(mine)], dtype=torch.float64))
        total_loss_tokens = max(1, int(counts[0].item()) // (deg.cp * deg.tp))  # shared samples once
        n_mb = int(self.d.all_reduce(torch.tensor([len(mbs)]), dist.ReduceOp.MAX)[0].item())
        # FSDP2 averages gradients over its dp * cp ranks; the loss is a global sum / N (each cp
        # rank's loss covering its own shard), so scale it back.
        scale = float(deg.dp * deg.cp)
        amp = autocast_context(tc, self.d.device, deg.fsdp)  # bf16 without FSDP: autocast

        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        # Loss and mismatch sums stay on the device until the step's one host read.
        acc = StepStats(self.d.device, len(moe_layer_ids(self.cfg.model)))
        # GLM-5 with a KL-trained indexer: L_I's gradient scale, and its sum over the step.
        train_indexer = tc.dsa_indexer == "kl" and bool(glm_attentions(self.model))
        indexer_scale = tc.dsa_indexer_loss_coef * scale / total_loss_tokens
        indexer_kl = torch.zeros((), dtype=torch.float64, device=self.d.device)
        indexer_queries = 0
        for i in range(n_mb):
            if i < len(mbs):
                mb = mbs[i].to(self.d.device)
                if deg.cp > 1:  # perf path: this rank's load-balanced sequence shard
                    mb = cp_micro_batch(mb, self.meshes["cp"], deg.cp)
                route = routes[i]
                # Backward inside too: an activation-checkpoint recompute must route the same way.
                with (
                    routing(
                        self.model,
                        to_device(route, self.d.device) if route is not None else None,
                        replay_at(tc, self.version + 1),
                    ) as rec,
                    micro_batch_attention(self.model, mb),
                    indexer_loss(self.model, indexer_scale) as attns,
                ):  # perf path: masks held over backward too
                    with amp:  # perf path: packed_logprobs picks the attention kernel
                        logp, ent = packed_logprobs(
                            self.model, mb, tc.logprob_chunk_tokens, entropy_grad=self.entropy.needs_grad
                        )
                    loss, st = ratio_loss(
                        logp,
                        mb.logp_infer,
                        mb.advantages,
                        mb.loss_mask,
                        ratio_low=tc.ratio_low,
                        ratio_high=tc.ratio_high,
                        total_loss_tokens=total_loss_tokens,
                        entropy=ent,
                        entropy_coef=self.entropy.coef,
                    )
                    (loss * scale).backward()
                if train_indexer:
                    indexer_kl += sum(a.indexer_loss_sum for a in attns if a.indexer_loss_sum is not None)
                    indexer_queries += int(mb.inputs.numel())
                on_policy = (
                    to_device(versions[i], logp.device) == self.version if versions is not None else None
                )
                acc.add(st, logp, mb, on_policy, rec)
            else:
                # This rank has fewer micro-batches than another: FSDP2 needs every rank in
                # every forward/backward (all-gather, reduce-scatter), so run a zero-weight one.
                dummy = torch.zeros((1, 1), dtype=torch.long, device=self.d.device)
                if deg.cp > 1:
                    dummy = cp_dummy_inputs(self.meshes["cp"], deg.cp, self.d.device)
                with amp:
                    out = self.model(dummy)
                (out.sum() * 0.0).backward()
        # The norm stays on the device: reading it here (before the optimizer) made the GPU idle
        # while the host launched AdamW; it is read with the other sums below.
        norm = _local(clip_grad_norm(self.model, tc.grad_clip, deg))  # perf path: EP-aware
        self.opt.step()
        sync_params(self.model)  # master weights: the stepped masters into the bf16 parameters
        # Cross-rank reduction on the device, then ONE device-to-host copy for every metric.
        g, n_tokens, mismatch, grad_norm = acc.read(norm, self.d.all_reduce_, copies=deg.tp)
        entropy = g.entropy_sum / max(1.0, g.loss_tokens)
        kl_stats = None
        if train_indexer:  # (kl mode only: one more small host read)
            sums = self.d.all_reduce(torch.stack([indexer_kl.cpu(), torch.tensor(float(indexer_queries))]))
            kl_stats = float(sums[0]) / max(1.0, float(sums[1]))
        coef = self.entropy.coef
        self.entropy.update(entropy)  # every rank sees the same all-reduced entropy
        return StepResult(
            loss=g.loss_sum,
            entropy=entropy,
            entropy_coef=coef,
            grad_norm=grad_norm,
            masked_ratio_frac=g.masked_tokens / max(1.0, g.loss_tokens),
            loss_tokens=int(g.loss_tokens),
            tokens=int(n_tokens) // deg.cp,  # every cp rank counted the whole sample
            compute_s=time.monotonic() - t0,
            mismatch=mismatch.summary(),
            dsa_indexer_kl=kl_stats,
        )

    # -------------------------------------------------------------- main loop

    def run(self) -> int:
        if not hasattr(self, "opt"):
            self.setup()
        max_steps = self.cfg.run.max_steps
        status = "done"
        while self.version < max_steps:
            if self.d.is_main:
                if self.bus is not None:
                    self._record_state("waiting")
                batch, entry_ids = self._collect()
            else:
                batch, entry_ids = Batch(stop=True, groups=[]), []
            batch = self.d.broadcast(batch)
            if batch.stop:
                status = "stopped"
                break
            v = self.version
            res = self.train_step(batch.groups)
            self.version = v + 1

            # perf path: gather now, write + set weights:latest in the background (trainer/publish.py);
            # publish_s is the time the loop was blocked (the gather, waiting on the last write).
            publish_s = self.publisher.publish(
                self.model, self.version, step_dir(self.run_dir, self.version), on_done=self._announce
            )
            if self.d.is_main and (p := self.publisher.last) is not None:  # newest finished write
                log_event(self.log, "weights written", **vars(p))
            tc = self.cfg.trainer
            if self.version % tc.checkpoint_every == 0 or (
                self.version >= max_steps and tc.checkpoint_on_stop
            ):
                self._checkpoint()
            if (bus := self.bus) is not None:
                # The ledger, the trainer state and the acks in one transaction (a crash before it
                # re-delivers the entries; the ledger then skips none twice).
                ids, state = [g.group_id for g in batch.groups], self._state("running")
                self._redis("commit", bus.commit_step, ids, self.version, entry_ids, state, v)
                m = self._metrics(v, batch, res, publish_s)
                self._redis("metrics", bus.push_metrics, m)
                log_event(self.log, "step", **m.model_dump())
        self.publisher.wait()  # perf path: the last version is on disk and published before exit
        if self.cfg.trainer.checkpoint_on_stop and self.version > self.last_checkpoint and self.version > 0:
            # Graceful stop: a checkpoint of what is published means a restart loses nothing.
            self._checkpoint()
        self._record_state(status)
        log_event(
            self.log,
            "trainer exit",
            status=status,
            version=self.version,
            rank=self.d.rank,
            **memory_held(self.d.device),
        )
        return 0

    def _metrics(self, v: int, batch: Batch, res: StepResult, publish_s: float) -> TrainerStepMetrics:
        samples = [s for g in batch.groups for s in g.samples]  # episodes, not their parts
        stale = [v - g.min_version for g in batch.groups]
        # (never negative: every version a group carries was published by this trainer's lineage)
        by_staleness = [0] * (max(stale, default=-1) + 1)
        for x in stale:
            by_staleness[max(x, 0)] += 1
        by_env: dict[str, list[float]] = {}
        for g in batch.groups:
            by_env.setdefault(g.env, []).extend(s.reward for s in g.samples)
        return TrainerStepMetrics(
            step=self.version,
            version=self.version,
            groups=len(batch.groups),
            samples=len(samples),
            tokens=res.tokens,
            loss=res.loss,
            entropy=res.entropy,
            grad_norm=res.grad_norm,
            reward=sum(s.reward for s in samples) / max(1, len(samples)),
            reward_by_env={k: sum(r) / len(r) for k, r in by_env.items()},
            staleness_mean=sum(stale) / max(1, len(stale)),
            staleness_max=max(stale, default=0),
            staleness_groups=by_staleness,
            masked_ratio_frac=res.masked_ratio_frac,
            dropped_stale=batch.dropped_stale,
            wait_data_s=batch.wait_s,
            step_s=res.compute_s,
            publish_s=publish_s,
            tokens_per_s=res.tokens / max(res.compute_s, 1e-9),
            loss_tokens=res.loss_tokens,
            sample_tokens_max=max((len(s.tokens) for s in samples), default=0),
            entropy_coef=res.entropy_coef,
            dsa_indexer_kl=res.dsa_indexer_kl,
            **res.mismatch,
        )


# ------------------------------------------------------------------ entry point


def _install_signals(trainer: Trainer) -> Callable[[], None]:
    """SIGTERM/SIGINT ask for a graceful stop at the next batch boundary. Only rank 0 acts on
    it (the others follow its broadcast); restores the previous handlers on exit."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(_sig: int, _frame: FrameType | None) -> None:
        trainer.stop_requested.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return restore


def run(cfg: RunConfig, run_dir: str | Path, redis_url: str, log: logging.Logger | None = None) -> int:
    d = Dist(cfg.trainer.device)
    trainer = Trainer(cfg, Path(run_dir), redis_url, d, log)
    restore = _install_signals(trainer)
    try:
        try:
            code = trainer.run()
        except Exception as e:
            if not disk_full(e):
                raise
            # Restarting would fail at the same write: give up (FATAL_EXIT: the supervisor does
            # not restart it) and leave no partial directory behind. Resumable once space is freed.
            trainer.on_disk_full(e)
            return FATAL_EXIT
        # Leave together: a rank that tears its gloo group down while a peer is still finishing
        # (rank 0 logging, publishing) can abort in the group's destructor ("terminate called
        # without an active exception"). Only on the normal path: after a crash a peer may be gone.
        d.barrier()
        return code
    finally:
        restore()
        d.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer", description="relay RL trainer")
    p.add_argument("--config", required=True, help="resolved run config (RUN_DIR/config.json)")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", ""))
    p.add_argument("--run-dir", required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.redis_url:
        raise SystemExit("trainer: --redis-url (or REDIS_URL) is required")
    log = setup_logging("trainer")
    cfg = load_resolved(args.config)
    return run(cfg, args.run_dir, args.redis_url, log)
