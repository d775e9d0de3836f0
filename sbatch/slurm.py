"""The Slurm launcher: a whole run as ONE heterogeneous job, submitted through submitit.

Components (het groups), in this order:
  0 head     1 node: Redis (AOF, under a supervisor), sandbox, orchestrator, KV gateway (with prefill)
  1 decode   slurm.decode.nodes nodes; decode.replicas services spread evenly over them
  2 trainer  slurm.trainer.nodes nodes; one torchrun per node (c10d rendezvous on trainer node 0)
  3 prefill  slurm.prefill.nodes nodes (omitted when 0); one prefill service per node

submitit 1.5.4 has no het-job support. What works (and what this renders): component 0's
resources are submitit's own parameters, every further component is a `#SBATCH hetjob` block in
submitit's `setup` lines (they stay in the #SBATCH header because they precede any command), and
`srun --het-group=0,1,...` runs one task per node across all components. Each task finds its
component from SLURM_PROCID and SLURM_NTASKS_HET_GROUP_<i> and runs `run_component`: it starts the
supervisors (sbatch/supervisor.py) of its node's services and watches them. `make launch ... DRY_RUN=1`
prints exactly the script submitit would submit, produced by the same submitit function.

Discovery: the head starts Redis on a free port and writes the resolved RUN_DIR/config.json
(redis.url = its host) and RUN_DIR/slurm/head.json; the other components wait for that file (RUN_DIR
is on a shared filesystem, as weights are) and from then on find each other through the Redis registry.
End of run: a trainer that exits 0 sets `<prefix>:control:shutdown`; every component then stops its
services (orchestrator first, Redis last) and the head writes RUN_DIR/summary.json. A supervisor that
gives up sets the same key with its reason. `make stop` sets it too, then scancels what is left.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import redis
from rich.console import Console

from sbatch.files import write_atomic
from sbatch.local import RUNS_DIR, make_run_dir, service_argv
from sbatch.summary import StepLine, print_summary, read_metrics_after, summarize
from sbatch.supervisor import FINAL_STATES, RestartPolicy, read_states, supervisor_argv
from services.common.auth import AuthError, RunSecrets, ensure_run_secrets, load_run_secrets, with_credentials
from services.common.bus import Bus, Keys, connect, run_prefix, wait_for_redis
from services.common.config import REPO_ROOT, ConfigError, RunConfig, SlurmComponent, slurm_time_minutes
from services.common.net import free_port
from services.common.redis_server import secure_conf
from services.kvstore.launch import resolve_ports
from trainer.launch import trainer_command

ROLES = ("head", "decode", "trainer", "prefill")
# Stop order within a node: nothing new is generated, then workers, the trainer, Redis last.
STOP_ORDER = ("orchestrator", "prefill", "decode", "sandbox", "kvstore", "trainer", "redis")
HEAD_FILE = "head.json"
TEST_CLUSTER_CONF = Path(os.environ.get("RELAY_SLURM_PREFIX", "/tmp/relay-slurm")) / "etc" / "slurm.conf"


# ---------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class ServiceSpec:
    name: str  # registry/supervisor/log name: decode.0, orchestrator, trainer.1, redis
    kind: str  # redis | sandbox | orchestrator | kvstore | decode | prefill | trainer
    index: int = 0
    gpus: str = ""  # CUDA_VISIBLE_DEVICES for this service when a node hosts several replicas
    node: int = 0  # engine_ranks: which node of its replica's engine (1..; rank 0's is the service's)


@dataclass(frozen=True)
class Component:
    group: int
    role: str
    nodes: int
    gpus_per_node: int
    cpus_per_node: int
    mem: str
    time: str
    partition: str
    constraint: str
    services: tuple[tuple[ServiceSpec, ...], ...]  # what runs on node rank 0, 1, ...


@dataclass(frozen=True)
class JobPlan:
    run_dir: str
    config_path: str
    prefix: str
    redis_url: str  # empty: the head starts Redis
    redis_port: int  # 0: a free port on the head
    rdzv_port: int  # 0: a free port on trainer node 0
    components: tuple[Component, ...]
    policy: RestartPolicy = field(default_factory=RestartPolicy)

    def component(self, role: str) -> Component | None:
        return next((c for c in self.components if c.role == role), None)


def _spread(kind: str, total: int, nodes: int, gpus_per_node: int) -> tuple[tuple[ServiceSpec, ...], ...]:
    """`total` replicas of `kind` over `nodes` nodes; each gets an equal slice of its node's GPUs.
    Fewer decode replicas than nodes: each replica's engine spans nodes / total nodes, the service
    (rank 0) on the first and a node host of its ranks (engine_ranks) on each other one."""
    if kind == "decode" and total < nodes:
        if nodes % total:
            raise ConfigError(f"{kind}: {total} replicas cannot span {nodes} nodes evenly")
        span = nodes // total
        return tuple(
            (ServiceSpec(f"{kind}.{n // span}", kind, n // span),)
            if n % span == 0
            else (
                ServiceSpec(f"{kind}.{n // span}.node{n % span}", "engine_ranks", n // span, node=n % span),
            )
            for n in range(nodes)
        )
    if total % nodes:
        raise ConfigError(f"{kind}: {total} replicas do not divide evenly over {nodes} nodes")
    per = total // nodes
    if gpus_per_node and gpus_per_node % per:
        raise ConfigError(f"{kind}: {per} replicas per node cannot split {gpus_per_node} GPUs evenly")
    g = gpus_per_node // per if gpus_per_node else 0
    out = []
    for n in range(nodes):
        specs = []
        for j in range(per):
            i = n * per + j
            gpus = ",".join(str(x) for x in range(j * g, (j + 1) * g)) if g and per > 1 else ""
            specs.append(ServiceSpec(f"{kind}.{i}", kind, i, gpus))
        out.append(tuple(specs))
    return tuple(out)


def build_plan(cfg: RunConfig, run_dir: Path) -> JobPlan:
    """The het job for this run; raises ConfigError when the config cannot be laid out."""
    s = cfg.slurm
    tc = cfg.trainer
    if tc.nproc % s.trainer.nodes:
        raise ConfigError(
            f"trainer.nproc ({tc.nproc}) must be a multiple of slurm.trainer.nodes ({s.trainer.nodes})"
        )
    per_node = tc.nproc // s.trainer.nodes
    if s.trainer.nodes > 1 and tc.nproc < 2:
        raise ConfigError("several trainer nodes need trainer.nproc > 1 (torchrun across them)")
    if s.trainer.gpus_per_node and per_node != s.trainer.gpus_per_node:
        raise ConfigError(
            f"trainer.nproc / slurm.trainer.nodes = {per_node} processes per node, but "
            f"slurm.trainer.gpus_per_node = {s.trainer.gpus_per_node}: one process per GPU"
        )
    head: list[ServiceSpec] = []
    if not cfg.redis.url:
        head.append(ServiceSpec("redis", "redis"))
    head += [ServiceSpec(f"sandbox.{i}", "sandbox", i) for i in range(cfg.sandbox.replicas)]
    if s.prefill.nodes or cfg.kvstore.enabled:
        # Prefill hands KV pages to decode through the KV store gateway (docs/kv.md).
        if cfg.kvstore.mooncake.enabled:
            head.append(ServiceSpec("mooncake_master", "kvstore.master"))  # the pool's master
        head.append(ServiceSpec("kvstore", "kvstore"))
    head.append(ServiceSpec("orchestrator", "orchestrator"))

    def comp(
        group: int, role: str, r: SlurmComponent, services: tuple[tuple[ServiceSpec, ...], ...]
    ) -> Component:
        return Component(
            group=group,
            role=role,
            nodes=r.nodes,
            gpus_per_node=r.gpus_per_node,
            cpus_per_node=r.cpus_per_node,
            mem=r.mem,
            time=r.time or s.time,
            partition=r.partition or s.partition,
            constraint=r.constraint,
            services=services,
        )

    trainer_names = (
        (("trainer",),) if s.trainer.nodes == 1 else tuple((f"trainer.{n}",) for n in range(s.trainer.nodes))
    )
    components = [
        comp(0, "head", s.head, (tuple(head),)),
        comp(
            1,
            "decode",
            s.decode,
            _spread("decode", cfg.decode.replicas, s.decode.nodes, s.decode.gpus_per_node),
        ),
        comp(
            2,
            "trainer",
            s.trainer,
            tuple(
                tuple(ServiceSpec(n, "trainer", i) for n in names) for i, names in enumerate(trainer_names)
            ),
        ),
    ]
    if s.prefill.nodes:
        components.append(
            comp(
                3,
                "prefill",
                s.prefill,
                _spread("prefill", s.prefill.nodes, s.prefill.nodes, s.prefill.gpus_per_node),
            )
        )
    sp = s.supervisor
    return JobPlan(
        run_dir=str(run_dir),
        config_path=str(run_dir / "config.json"),
        prefix=run_prefix(cfg.redis.prefix, run_dir.name),
        redis_url=cfg.redis.url,
        redis_port=s.redis_port,
        rdzv_port=s.rdzv_port,
        components=tuple(components),
        policy=RestartPolicy.of(sp),
    )


def resolved_config(cfg: RunConfig, plan: JobPlan, redis_url: str) -> RunConfig:
    """The config every service reads: namespaced prefix, Redis URL, services bound on all interfaces
    (they advertise their hostname in the registry; 127.0.0.1 would be unreachable from other nodes)."""
    upd: dict[str, Any] = {"redis": cfg.redis.model_copy(update={"url": redis_url, "prefix": plan.prefix})}
    for sec in ("decode", "sandbox", "orchestrator", "kvstore", "prefill"):
        upd[sec] = getattr(cfg, sec).model_copy(update={"host": "0.0.0.0"})
    # Mooncake master ports left at 0 are picked here; the head rewrites config.json on its own
    # node at start (it runs the master and the gateway), so the ports are free where they bind.
    return resolve_ports(cfg.model_copy(update=upd))


def multinode_trainer_argv(argv: list[str], nnodes: int, endpoint: str, rdzv_id: str) -> list[str]:
    """trainer_command's single-host torchrun (--standalone) -> a c10d rendezvous across nodes."""
    if nnodes == 1:
        return argv
    if "--standalone" not in argv:
        raise ConfigError("several trainer nodes need trainer.nproc > 1 (torchrun across them)")
    out: list[str] = []
    for a in argv:
        if a == "--standalone":
            out += [
                f"--nnodes={nnodes}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id={rdzv_id}",
            ]
        elif a.startswith("--nproc_per_node="):
            out.append(f"--nproc_per_node={int(a.split('=', 1)[1]) // nnodes}")
        else:
            out.append(a)
    return out


def redis_argv(run_dir: Path, port: int | str) -> list[str]:
    from services.common.redis_server import server_argv

    # On every interface: the other components reach it from their nodes. The password and
    # protected mode are in the head's RUN_DIR/redis/redis-auth.conf (mode 0600, secure_conf),
    # not on this command line.
    return server_argv(port, run_dir / "redis", bind="0.0.0.0")


def service_command(
    spec: ServiceSpec,
    cfg: RunConfig,
    plan: JobPlan,
    redis_url: str,
    redis_port: int | str = 0,
    trainer_endpoint: str = "",
    rdzv_id: str = "",
) -> list[str]:
    """The command of one service on its node: the local executor's process plan (service_argv,
    trainer_command), adapted for several nodes."""
    run_dir = Path(plan.run_dir)
    if spec.kind == "redis":
        return redis_argv(run_dir, redis_port)
    if spec.kind == "trainer":
        trainer = plan.component("trainer")
        assert trainer is not None
        argv = trainer_command(cfg, run_dir, redis_url)
        return multinode_trainer_argv(argv, trainer.nodes, trainer_endpoint, rdzv_id)
    if spec.kind == "engine_ranks":
        return engine_ranks_argv(Path(plan.config_path), redis_url, spec.index, spec.node)
    return service_argv(f"services.{spec.kind}", Path(plan.config_path), redis_url, spec.index)


def engine_ranks_argv(config_path: Path, redis_url: str, index: int, node: int) -> list[str]:
    """Node `node` of decode replica `index`'s engine: its ranks, at the rendezvous rank 0 publishes."""
    return [
        sys.executable, "-m", "services.engine.parallel.node", "--config", str(config_path),
        "--redis-url", redis_url, "--role", "decode", "--index", str(index), "--node", str(node),
    ]  # fmt: skip


MODULES = {"trainer": "trainer", "engine_ranks": "services.engine.parallel.node"}


def missing_modules(plan: JobPlan) -> list[str]:
    kinds = {s.kind for c in plan.components for node in c.services for s in node} - {"redis"}
    mods = {k: MODULES.get(k, f"services.{k}") for k in kinds}
    return sorted(f"{m} ({k})" for k, m in mods.items() if importlib.util.find_spec(m) is None)


# ---------------------------------------------------------------------- the sbatch script


def _flags(**kv: Any) -> list[str]:
    out = []
    for k, v in kv.items():
        if v in (None, "", False):
            continue
        flag = "--" + k.replace("_", "-")
        out.append(f"#SBATCH {flag}" if v is True else f"#SBATCH {flag}={v}")
    return out


def sbatch_parameters(cfg: RunConfig, plan: JobPlan) -> dict[str, Any]:
    """submitit SlurmExecutor parameters: component 0 natively, the others as hetjob blocks."""
    s = cfg.slurm
    job_name = s.job_name or f"relay-{cfg.run.name}"
    head = plan.components[0]
    het: list[str] = []
    for c in plan.components[1:]:
        het.append("#SBATCH hetjob")
        het += _flags(
            job_name=job_name,
            partition=c.partition,
            account=s.account,
            qos=s.qos,
            time=slurm_time_minutes(c.time),  # minutes, as submitit renders component 0's
            nodes=c.nodes,
            ntasks_per_node=1,
            cpus_per_task=c.cpus_per_node,
            mem=c.mem,
            gpus_per_node=c.gpus_per_node or None,
            constraint=c.constraint,
            exclusive=s.exclusive,
        )
    groups = ",".join(str(c.group) for c in plan.components)
    extra: dict[str, Any] = {"mem": head.mem}  # submitit would rewrite `mem` as GB: pass Slurm's syntax
    if head.constraint:
        extra["constraint"] = head.constraint
    params: dict[str, Any] = {
        "job_name": job_name,
        "nodes": 1,
        "ntasks_per_node": 1,
        "cpus_per_task": head.cpus_per_node,
        "time": slurm_time_minutes(head.time),
        "stderr_to_stdout": True,
        # submitit's USR2 (time limit / preemption) comes this long before the kill.
        "signal_delay_s": 120,
        # hetjob blocks first: sbatch reads #SBATCH lines only up to the first command.
        "setup": het + list(s.setup),
        "srun_args": [f"--het-group={groups}"],
        "additional_parameters": extra,
    }
    if head.partition:
        params["partition"] = head.partition
    if s.account:
        params["account"] = s.account
    if s.qos:
        params["qos"] = s.qos
    if head.gpus_per_node:
        params["gpus_per_node"] = head.gpus_per_node
    if s.exclusive:
        params["exclusive"] = True
    return params


def submitit_folder(cfg: RunConfig, run_dir: Path) -> Path:
    # No %j in it: het components have distinct job ids and would each expand it differently.
    return Path(cfg.slurm.folder).resolve() if cfg.slurm.folder else run_dir / "slurm"


def render_script(cfg: RunConfig, plan: JobPlan) -> str:
    """Exactly the batch script submitit writes for this job (same function, same parameters)."""
    from submitit.slurm.slurm import _make_sbatch_string

    folder = submitit_folder(cfg, Path(plan.run_dir))
    command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    return _make_sbatch_string(command=command, folder=folder, **sbatch_parameters(cfg, plan))


# ---------------------------------------------------------------------- sizing (dry run, docs)


def sizing(cfg: RunConfig) -> dict[str, float]:
    """Back-of-envelope memory for the plan: weights, trainer state per GPU, KV cache per token."""
    from sbatch.plan import kv_bytes_per_token, recurrent_state_bytes

    m = cfg.model
    p = m.param_counts()
    kv_token = kv_bytes_per_token(m)
    out = {
        "params_total_b": p["total"] / 1e9,
        "params_active_b": p["active"] / 1e9,
        "weights_bf16_gb": p["total"] * 2 / 1e9,
        "weights_fp8_gb": p["total"] / 1e9,
        # fp32 params + fp32 grads + Adam m and v: 16 bytes/param, sharded over every trainer GPU (FSDP)
        "train_state_tb": p["total"] * 16 / 1e12,
        "kv_kb_per_token": kv_token / 1024,
        "kv_gb_per_max_seq": kv_token * cfg.decode.engine.max_seq_len / 1e9,
        "state_mb_per_seq": recurrent_state_bytes(m) / 1e6,
    }
    tgpus = cfg.slurm.trainer.nodes * cfg.slurm.trainer.gpus_per_node
    if tgpus:
        out["train_state_gb_per_gpu"] = p["total"] * 16 / tgpus / 1e9
    return out


def describe(cfg: RunConfig, plan: JobPlan) -> str:
    """The component plan, human-readable (dry run and submit)."""
    lines = [f"het job: {len(plan.components)} components, {sum(c.nodes for c in plan.components)} nodes"]
    for c in plan.components:
        res = f"{c.nodes} node(s) x {c.gpus_per_node} GPU, {c.cpus_per_node} CPU, mem {c.mem}"
        lines.append(
            f"  group {c.group} {c.role:<8} {res}, time {c.time}, partition {c.partition or '(default)'}"
        )
        for rank, node in enumerate(c.services):
            # Long components: first two nodes, an ellipsis, the last one.
            if len(c.services) > 4 and 2 <= rank < len(c.services) - 1:
                if rank == 2:
                    lines.append(f"    ... nodes 2-{len(c.services) - 2} alike")
                continue
            lines.append(
                f"    node {rank}: "
                + ", ".join(s.name + (f" [gpus {s.gpus}]" if s.gpus else "") for s in node)
            )
    lines.append("commands (per service, under sbatch/supervisor.py):")
    url = plan.redis_url or f"redis://<head>:{plan.redis_port or '<port>'}/0"
    trainer = plan.component("trainer")
    for c in plan.components:
        # The first node of each component; a decode engine spanning nodes: all of its first replica's.
        span = [n for n in c.services if all(s.index == 0 for s in n)] if c.role == "decode" else []
        for node in span if len(span) > 1 else c.services[:1]:
            for spec in node:
                argv = service_command(
                    spec,
                    cfg,
                    plan,
                    url,
                    plan.redis_port or "<port>",
                    f"<trainer-0>:{plan.rdzv_port or '<port>'}",
                    "<jobid>",
                )
                lines.append(f"  {spec.name}: {shlex.join(argv)}")
    if trainer and trainer.nodes > 1:
        lines.append(f"  (trainer.1 .. trainer.{trainer.nodes - 1}: same command on their nodes)")
    span = cfg.engine_nodes("decode")
    if span > 1:
        per = cfg.decode.parallel.ranks // span
        lines.append(
            f"  (each decode engine spans {span} nodes, {per} rank(s) on each: decode.i, on the first, is"
            f" rank 0 and starts its node's other ranks; decode.i.nodeN starts the {per} rank(s) of"
            f" node N, from rank N x {per}, at the rendezvous rank 0 publishes in Redis)"
        )
    sz = sizing(cfg)
    lines.append(
        "sizing: {params_total_b:.1f}B params ({params_active_b:.1f}B active); weights {weights_bf16_gb:.0f} GB bf16 / "
        "{weights_fp8_gb:.0f} GB fp8; trainer state {train_state_tb:.2f} TB; KV {kv_kb_per_token:.1f} KiB/token, "
        "{kv_gb_per_max_seq:.2f} GB per max-length sequence".format(**sz)
        + (f" + {sz['state_mb_per_seq']:.0f} MB of recurrent state" if sz["state_mb_per_seq"] else "")
        + (
            f"; trainer state per GPU {sz['train_state_gb_per_gpu']:.0f} GB"
            if "train_state_gb_per_gpu" in sz
            else ""
        )
    )
    lines += engine_lines(cfg, plan)
    return "\n".join(lines)


def engine_lines(cfg: RunConfig, plan: JobPlan) -> list[str]:
    """Each inference engine's ranks over its GPUs and the memory per GPU that implies (plan.py)."""
    from sbatch.plan import DEVICES, engine_layout, render_layout

    dev = DEVICES[cfg.plan.gpu]
    lines = [f"engines (one rank per GPU; memory on {dev.name}, plan.gpu):"]
    for role in ("decode", "prefill"):
        c = plan.component(role)
        if c is not None and c.nodes:
            lines += render_layout(engine_layout(cfg, role, dev), c.gpus_per_node)  # type: ignore[arg-type]
    return lines


# ---------------------------------------------------------------------- inside the job


def het_position(env: dict[str, str] | os._Environ[str]) -> tuple[int, int]:
    """(het group, rank within it) of this task of a `srun --het-group=...` step."""
    procid = int(env.get("SLURM_PROCID", "0"))
    counts = []
    while f"SLURM_NTASKS_HET_GROUP_{len(counts)}" in env:
        counts.append(int(env[f"SLURM_NTASKS_HET_GROUP_{len(counts)}"]))
    if not counts:
        return 0, procid
    offset = 0
    for g, n in enumerate(counts):
        if procid < offset + n:
            return g, procid - offset
        offset += n
    raise RuntimeError(f"SLURM_PROCID {procid} is beyond the het groups' {sum(counts)} tasks")


def _say(msg: str, **fields: Any) -> None:
    print(json.dumps({"ts": round(time.time(), 3), "logger": "component", "msg": msg, **fields}), flush=True)


class ComponentTask:
    """One task of the het job (one node): starts its services' supervisors, watches them and the
    run-wide shutdown key, and stops them in order. The head also owns Redis and the summary."""

    def __init__(self, plan: JobPlan, group: int, rank: int):
        self.plan = plan
        self.comp = plan.components[group]
        self.rank = rank
        self.specs = self.comp.services[rank] if rank < len(self.comp.services) else ()
        self.run_dir = Path(plan.run_dir)
        self.job_id = os.environ.get("SLURM_JOB_ID", "local")
        self.host = socket.gethostname()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started: dict[str, tuple[ServiceSpec, list[str], str]] = {}  # what _start ran, by name
        self.revived: dict[str, int] = {}
        self.codes: dict[str, int] = {}
        self.stop_reason = ""
        self.r: redis.Redis | None = None
        self.t0 = time.time()
        self.cfg: RunConfig | None = None
        self.secrets = RunSecrets(token="-" * 32)  # the run's, loaded when the task starts

    # -- setup

    def _on_term(self, signum: int, _frame: object) -> None:
        # scancel / time limit: stop our services in order (submitit itself ignores SIGTERM).
        self.stop_reason = self.stop_reason or f"signal {signal.Signals(signum).name}"

    def _start(self, spec: ServiceSpec, argv: list[str], redis_url: str) -> None:
        self.started[spec.name] = (spec, argv, redis_url)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "REDIS_URL": redis_url}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
        env.setdefault("OMP_NUM_THREADS", "1")
        if spec.gpus:
            env["CUDA_VISIBLE_DEVICES"] = spec.gpus
        # The het step's SLURM_* variables describe this task, not the service: torch and other
        # tools would misread them (e.g. as a distributed launch), so services do not inherit them.
        for k in [k for k in env if k.startswith(("SLURM_", "SUBMITIT_"))]:
            del env[k]
        sup = supervisor_argv(
            spec.name,
            argv,
            self.plan.policy,
            redis_url,
            self.plan.prefix,
            probe={"redis": "redis", "trainer": "none", "engine_ranks": "none"}.get(spec.kind, "http"),
            # Per host: a pid is only meaningful where the process runs.
            pid_file=self.run_dir / "pids" / f"{spec.name}.{self.host}.pid",
            log=self.run_dir / "logs" / f"{spec.name}.log",
        )
        self.procs[spec.name] = subprocess.Popen(
            sup,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
        _say("started", service=spec.name, pid=self.procs[spec.name].pid, host=self.host)

    def _wait_head(self, timeout_s: float = 900.0) -> str:
        """Other components: wait until the head published this job's Redis URL."""
        path = self.run_dir / "slurm" / HEAD_FILE
        deadline = time.monotonic() + timeout_s
        while not self.stop_reason:
            try:
                head = json.loads(path.read_text())
                if head.get("job_id") == self.job_id:
                    wait_for_redis(head["redis_url"], 30)
                    return str(head["redis_url"])
            except (FileNotFoundError, json.JSONDecodeError, redis.RedisError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the head did not publish Redis within {timeout_s:.0f}s ({path})")
            time.sleep(0.5)
        raise InterruptedError(self.stop_reason)

    def _start_head_redis(self, cfg: RunConfig) -> str:
        if self.plan.redis_url:
            url = self.plan.redis_url
        else:
            port = self.plan.redis_port or free_port()
            secure_conf(self.run_dir / "redis", self.secrets.redis_password)
            url = f"redis://{self.host}:{port}/0"
            spec = next(s for s in self.specs if s.kind == "redis")
            self._start(spec, redis_argv(self.run_dir, port), url)
        wait_for_redis(url, 60)
        # A resumed (or requeued) run's Redis holds the request that stopped its last job.
        keys = Keys(self.plan.prefix)
        connect(url).delete(keys.control_shutdown, keys.control_stop)
        # Services read RUN_DIR/config.json: give it the live URL before anything else starts.
        write_atomic(Path(self.plan.config_path), resolved_config(cfg, self.plan, url).dump())
        write_atomic(
            self.run_dir / "slurm" / HEAD_FILE,
            json.dumps({"job_id": self.job_id, "redis_url": url, "host": self.host, "time": time.time()}),
        )
        _say("redis ready", url=url)
        return url

    def _trainer_endpoint(self) -> str:
        """Trainer node 0 publishes host:port for torchrun's c10d rendezvous; the others read it."""
        assert self.r is not None
        key = Keys(self.plan.prefix).slurm_rendezvous(self.job_id)
        if self.rank == 0:
            endpoint = f"{self.host}:{self.plan.rdzv_port or free_port()}"
            self.r.set(key, endpoint)
            return endpoint
        while not self.stop_reason:
            got = self.r.get(key)
            if got:
                return str(got)
            time.sleep(0.5)
        raise InterruptedError(self.stop_reason)

    # -- run

    def run(self) -> dict[str, Any]:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "slurm").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "pids").mkdir(parents=True, exist_ok=True)
        _say(
            "task",
            role=self.comp.role,
            group=self.comp.group,
            rank=self.rank,
            host=self.host,
            job=self.job_id,
        )
        from services.common.config import load_resolved

        code = 1
        try:
            # The run's secrets (written by the submit side, mode 0600, on the shared run
            # directory): this task's own Redis clients and every service it starts use them.
            self.secrets = load_run_secrets(self.run_dir)
            os.environ.update(self.secrets.env())
            if self.comp.role == "head" and self.rank == 0:
                redis_url = self._start_head_redis(load_resolved(self.plan.config_path))
            else:
                redis_url = self._wait_head()
            cfg = self.cfg = load_resolved(self.plan.config_path)
            self.r = connect(redis_url)
            endpoint = self._trainer_endpoint() if self.comp.role == "trainer" and self.comp.nodes > 1 else ""
            for spec in self.specs:
                if spec.kind != "redis":
                    argv = service_command(spec, cfg, self.plan, redis_url, 0, endpoint, self.job_id)
                    self._start(spec, argv, redis_url)
            code = self._watch()
        except InterruptedError:
            code = 130
        finally:
            self._stop_all()
        return {
            "group": self.comp.group,
            "role": self.comp.role,
            "rank": self.rank,
            "host": self.host,
            "exit_codes": self.codes,
            "reason": self.stop_reason,
            "code": code,
            "summary": str(self.run_dir / "summary.json") if self.comp.role == "head" else "",
        }

    def _shutdown(self, reason: str) -> None:
        """Ask every component to stop (first reason wins)."""
        assert self.r is not None
        try:
            self.r.set(Keys(self.plan.prefix).control_shutdown, reason, nx=True)
        except redis.RedisError:
            pass

    def _watch(self) -> int:
        assert self.r is not None
        code = 0
        while True:
            for name, p in list(self.procs.items()):
                rc = p.poll()
                if rc is None or name in self.codes:
                    continue
                if rc < 0 and not self.stop_reason:
                    # Killed from outside (not finished, not given up): the watchdog starts it again;
                    # the new supervisor first waits for the child the old one left behind.
                    self.revived[name] = self.revived.get(name, 0) + 1
                    _say("supervisor killed: starting it again", service=name, signal=-rc)
                    self._start(*self.started[name])
                    continue
                self.codes[name] = rc
                _say("supervisor exited", service=name, code=rc)
                if name.startswith("trainer") and rc == 0:
                    self._shutdown("trainer finished")
                elif rc != 0:
                    self._shutdown(f"{name} failed (exit {rc})")
                    code = rc
            if self.stop_reason:
                return 130 if self.stop_reason.startswith("signal") else code
            try:
                reason = self.r.get(Keys(self.plan.prefix).control_shutdown)
            except redis.RedisError:
                reason = None  # Redis restarting under its supervisor: keep going
            if reason:
                self.stop_reason = str(reason)
                if reason == "trainer finished":
                    return code
                return code or (130 if reason.startswith("stop") else 1)
            if self.procs and all(n in self.codes for n in self.procs):
                return code
            time.sleep(0.5)

    def _stop(self, names: list[str]) -> None:
        live = [n for n in names if self.procs[n].poll() is None]
        for n in live:
            try:
                os.killpg(self.procs[n].pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for n in live:
            try:
                self.procs[n].wait(self.plan.policy.stop_timeout_s + 10)
            except subprocess.TimeoutExpired:
                os.killpg(self.procs[n].pid, signal.SIGKILL)
                self.procs[n].wait()
        for n in names:
            self.codes.setdefault(n, self.procs[n].returncode)

    def _stop_all(self) -> None:
        is_head = self.comp.role == "head" and self.rank == 0
        if is_head and self.stop_reason == "trainer finished":
            time.sleep(2.0)  # the orchestrator writes the last metrics line after the trainer's
        for kind in STOP_ORDER:
            if kind == "redis" and is_head:
                self._finish_head()
            self._stop([n for n in self.procs if n.split(".")[0] == kind])
        self._stop(list(self.procs))

    def _finish_head(self) -> None:
        """Before Redis goes: let the other components stop, then write the run summary."""
        if self.r is None or self.cfg is None:
            return
        deadline = time.monotonic() + self.plan.policy.stop_timeout_s + 30
        mine = set(self.procs)
        while time.monotonic() < deadline:
            try:
                others = [s for s in read_states(self.r, self.plan.prefix) if s["name"] not in mine]
            except redis.RedisError:
                break
            if all(s["state"] in FINAL_STATES for s in others):
                break
            time.sleep(0.5)
        try:
            code = 0 if self.stop_reason == "trainer finished" else (130 if "stop" in self.stop_reason else 1)
            bus = Bus(self.cfg.redis.url, self.cfg.redis.prefix)
            summary = summarize(self.cfg, self.run_dir, bus, time.time() - self.t0, code)
            summary["stop_reason"] = self.stop_reason
            summary["slurm_job_id"] = self.job_id
            write_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2))
            _say("summary written", status=summary["status"])
        except Exception as e:  # noqa: BLE001 - a failed summary must not keep Redis and the job alive
            _say("summary failed", error=repr(e))


def run_component(plan: JobPlan) -> dict[str, Any]:
    """The function submitit runs in every task of the het step."""
    group, rank = het_position(os.environ)
    return ComponentTask(plan, group, rank).run()


# ---------------------------------------------------------------------- the submit side


def ensure_slurm_conf() -> None:
    """Use the repo's test cluster (sbatch/cluster.sh) when no other Slurm config is in sight."""
    if (
        "SLURM_CONF" not in os.environ
        and not Path("/etc/slurm/slurm.conf").exists()
        and TEST_CLUSTER_CONF.exists()
    ):
        os.environ["SLURM_CONF"] = str(TEST_CLUSTER_CONF)


def slurm_info(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "slurm.json"
    return json.loads(path.read_text()) if path.exists() else None


def job_states(job_id: str) -> list[str] | None:
    """Per-component state lines of a job still known to squeue; [] once it has left the queue,
    None when squeue could not tell (controller busy or unreachable: ask again later)."""
    ensure_slurm_conf()
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%i %T %M %R"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return None
    if out.returncode == 0:
        return [line for line in out.stdout.splitlines() if line.strip()]
    # A job purged from the controller's memory (MinJobAge after it ended) is an "invalid job id".
    return [] if "invalid job id" in out.stderr.lower() else None


def job_gone(job_id: str) -> bool:
    return job_states(job_id) == []


def dry_run(cfg: RunConfig, console: Console) -> int:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.run.dir).resolve() if cfg.run.dir else RUNS_DIR / f"{cfg.run.name}-{stamp}"
    try:
        plan = build_plan(cfg, run_dir)
        script = render_script(cfg, plan)
    except ConfigError as e:
        console.print(f"[red]{e}[/]")
        return 2
    print(f"# relay dry run: {cfg.run.name}, launcher slurm; nothing submitted; run dir would be {run_dir}")
    print("# ---- sbatch script (as submitit writes it) ----")
    print(script)
    print("# ---- component plan ----")
    print(describe(cfg, plan))
    missing = missing_modules(plan)
    if missing:
        print(f"# note: not in this checkout yet, submission would be refused: {', '.join(missing)}")
    return 0


def submit(cfg: RunConfig, console: Console, resume: bool = False) -> int:
    """Submit the run's het job; `resume`: the run directory exists, the job continues it (the
    head restarts Redis on RUN_DIR/redis, step lines go on after the last one printed)."""
    ensure_slurm_conf()
    if shutil.which("sbatch") is None:
        console.print(
            "[red]no `sbatch` on PATH: not on a Slurm cluster (sbatch/cluster.sh start makes a test one)[/]"
        )
        return 2
    import submitit

    t0 = time.time()
    run_dir = make_run_dir(cfg)
    try:
        plan = build_plan(cfg, run_dir)
    except ConfigError as e:
        console.print(f"[red]{e}[/]")
        return 2
    missing = missing_modules(plan)
    if missing:
        console.print(f"[red]this plan needs modules this checkout lacks: {', '.join(missing)}[/]")
        return 2
    # The run token and Redis credentials, read by every component from the shared run directory.
    _secrets, public_url = ensure_run_secrets(run_dir, cfg.redis.url)
    if public_url != cfg.redis.url:
        cfg = cfg.model_copy(update={"redis": cfg.redis.model_copy(update={"url": public_url})})
        plan = build_plan(cfg, run_dir)
    (run_dir / "slurm").mkdir(exist_ok=True)
    (run_dir / "slurm" / HEAD_FILE).unlink(missing_ok=True)
    # The head rewrites this with the live Redis URL once the job runs.
    Path(plan.config_path).write_text(resolved_config(cfg, plan, plan.redis_url).dump())
    (run_dir / "slurm" / "plan.json").write_text(json.dumps(asdict(plan), indent=2))
    (run_dir / "slurm" / "plan.txt").write_text(describe(cfg, plan) + "\n")
    folder = submitit_folder(cfg, run_dir)
    ex = submitit.SlurmExecutor(folder=folder, python=shlex.quote(sys.executable))
    ex.update_parameters(**sbatch_parameters(cfg, plan))
    try:
        job = ex.submit(run_component, plan)
    except (
        subprocess.CalledProcessError,
        submitit.core.utils.UncompletedJobError,
        submitit.core.utils.FailedSubmissionError,
    ) as e:
        detail = getattr(e, "stderr", None) or getattr(e, "output", None) or e
        if isinstance(detail, bytes):
            detail = detail.decode(errors="replace")
        console.print(f"[red]sbatch refused the job: {str(detail).strip()}[/]")
        console.print(f"script: {folder}; SLURM_CONF={os.environ.get('SLURM_CONF', '(default)')}")
        return 2
    (run_dir / "slurm.json").write_text(
        json.dumps({"job_id": job.job_id, "folder": str(folder), "submitted": time.time()}, indent=2)
    )
    console.print(f"[bold]relay[/] run [cyan]{cfg.run.name}[/] -> {run_dir}")
    console.print(f"submitted het job {job.job_id} ({len(plan.components)} components); script {folder}")
    console.print(describe(cfg, plan).split("\ncommands")[0])
    if not cfg.slurm.follow:
        console.print(
            "not following (slurm.follow=false): `make status`, `make logs SERVICE=...`, `make stop`"
        )
        return 0
    seen = len(read_metrics_after(run_dir / "metrics.jsonl", 0)) if resume else 0
    return follow(cfg, run_dir, job.job_id, console, t0, seen)


def follow(cfg: RunConfig, run_dir: Path, job_id: str, console: Console, t0: float, seen: int = 0) -> int:
    """Print step lines from RUN_DIR/metrics.jsonl until the job leaves the queue."""
    line = StepLine(cfg)
    path = run_dir / "metrics.jsonl"
    printed, size, started, last_check = seen, -1, False, 0.0
    deadline = time.monotonic() + cfg.run.timeout_s
    console.print(line.header())
    try:
        while True:
            now_size = path.stat().st_size if path.exists() else -1
            if now_size != size:
                size = now_size
                for rec in read_metrics_after(path, printed):
                    printed += 1
                    console.print(line.format(rec))
            if time.monotonic() - last_check > 2.0:
                last_check = time.monotonic()
                states = job_states(job_id)
                if states and not started and all(" RUNNING " in s for s in states):
                    started = True
                    console.print(f"job {job_id} running after {time.time() - t0:.1f}s")
                if states == []:  # None (squeue did not answer) is not "gone"
                    break
                if time.monotonic() > deadline:
                    console.print(
                        f"[red]run timed out after {cfg.run.timeout_s:.0f}s: stopping job {job_id}[/]"
                    )
                    stop_job(run_dir, console, "stop: run.timeout_s")
                    break
            time.sleep(0.5)
    except KeyboardInterrupt:
        console.print(f"detached; job {job_id} keeps running (`make status`, `make stop`)")
        return 130
    for rec in read_metrics_after(path, printed):
        console.print(line.format(rec))
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        console.print(f"[red]job {job_id} ended without a summary: see {run_dir}/logs and {run_dir}/slurm[/]")
        return 1
    summary = json.loads(summary_path.read_text())
    print_summary(console, summary)
    return {"completed": 0, "stopped": 130, "timed out": 124}.get(summary["status"], 1)


def stop_job(run_dir: Path, console: Console, reason: str = "stop requested (make stop)") -> int:
    """Ordered stop through Redis (orchestrator first, summary written), scancel what remains."""
    info = slurm_info(run_dir)
    if info is None:
        console.print(f"{run_dir.name} is not a Slurm run")
        return 1
    job_id = str(info["job_id"])
    if job_gone(job_id):
        console.print(f"job {job_id} is not in the queue any more")
        return 0
    try:
        from services.common.config import load_resolved

        cfg = load_resolved(run_dir / "config.json")
        if cfg.redis.url:
            url = with_credentials(cfg.redis.url, load_run_secrets(run_dir))
            connect(url).set(Keys(cfg.redis.prefix).control_shutdown, reason, nx=True)
            console.print(f"asked job {job_id} to stop ({reason})")
            deadline = time.monotonic() + cfg.slurm.supervisor.stop_timeout_s + 60
            while not job_gone(job_id) and time.monotonic() < deadline:
                time.sleep(1.0)
    except (redis.RedisError, OSError, ValueError, AuthError) as e:
        console.print(f"Redis unreachable ({e}); cancelling directly")
    if not job_gone(job_id):
        subprocess.run(["scancel", job_id], check=False)
        console.print(f"scancel {job_id}")
    return 0


def suppress_submitit_warnings() -> None:
    # Without accounting (sacct) submitit warns on every state poll; our status comes from squeue.
    warnings.filterwarnings("ignore", module="submitit")
