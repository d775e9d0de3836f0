"""The Slurm launcher: plan and script rendering (debug, glm5), config validation, and real het jobs
on the single-host test cluster (sbatch/cluster.sh, via the session fixture `slurm_cluster`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from sbatch import slurm
from services.common.config import REPO_ROOT, ConfigError, ModelConfig, load_config, slurm_time_minutes

# Debug-sized resources that fit the test cluster's virtual nodes.
SMALL = ["--slurm.launcher=slurm", "--slurm.time=10"] + [
    f"--slurm.{c}.mem=1G" for c in ("head", "decode", "trainer", "prefill")
]


def sbatch_lines(script: str) -> list[str]:
    """The #SBATCH header as sbatch reads it: up to the first command line."""
    out = []
    for line in script.splitlines():
        s = line.strip()
        if s.startswith("#SBATCH"):
            out.append(s)
        elif s and not s.startswith("#"):
            break
    return out


def het_blocks(script: str) -> list[list[str]]:
    blocks: list[list[str]] = [[]]
    for line in sbatch_lines(script):
        if line == "#SBATCH hetjob":
            blocks.append([])
        else:
            blocks[-1].append(line)
    return blocks


def opt(block: list[str], name: str) -> str | None:
    for line in block:
        m = re.fullmatch(rf"#SBATCH --{name}(?:=(.*))?", line)
        if m:
            return m.group(1) or "true"
    return None


# ---------------------------------------------------------------------- rendering


def test_debug_renders_three_component_het_job(tmp_path: Path) -> None:
    cfg = load_config("debug", ["--slurm.launcher=slurm"])
    plan = slurm.build_plan(cfg, tmp_path / "run")
    assert [c.role for c in plan.components] == ["head", "decode", "trainer"]
    assert [[s.name for s in node] for node in plan.components[0].services] == [
        ["redis", "sandbox.0", "orchestrator"]
    ]
    assert plan.components[1].services == ((slurm.ServiceSpec("decode.0", "decode", 0),),)
    script = slurm.render_script(cfg, plan)
    blocks = het_blocks(script)
    assert len(blocks) == 3
    for b in blocks:
        assert opt(b, "nodes") == "1" and opt(b, "ntasks-per-node") == "1"
        assert opt(b, "cpus-per-task") == "2" and opt(b, "mem") == "4G" and opt(b, "time") == "240"
        assert opt(b, "gpus-per-node") is None
    srun = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1 and "--het-group=0,1,2" in srun[0]
    assert "submitit.core._submit" in srun[0]
    # no %j in the folder: het components would expand it to different ids
    assert str(tmp_path / "run" / "slurm") in srun[0]


def test_dry_run_cli_prints_script_and_plan_without_a_run_dir() -> None:
    before = set((REPO_ROOT / "runs").glob("*")) if (REPO_ROOT / "runs").exists() else set()
    out = subprocess.run(
        [sys.executable, "-m", "sbatch.launch", "run", "debug", "--dry-run", "--slurm.launcher=slurm"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "#SBATCH hetjob" in out.stdout and "--het-group=0,1,2" in out.stdout
    assert "group 1 decode" in out.stdout and "trainer: " in out.stdout
    after = set((REPO_ROOT / "runs").glob("*")) if (REPO_ROOT / "runs").exists() else set()
    assert after == before, "a dry run must not create run directories"
    # local launcher: the process plan
    out = subprocess.run(
        [sys.executable, "-m", "sbatch.launch", "run", "debug", "--dry-run"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "launcher local" in out.stdout
    assert re.search(r"^decode\.0: .* -m services\.decode ", out.stdout, re.M)


def test_glm5_renders_28_gpu_nodes_plus_head(tmp_path: Path) -> None:
    cfg = load_config("glm5")
    assert cfg.slurm.launcher == "slurm"
    plan = slurm.build_plan(cfg, tmp_path / "run")
    roles = {c.role: c for c in plan.components}
    assert [c.role for c in plan.components] == ["head", "decode", "trainer", "prefill"]
    assert (roles["trainer"].nodes, roles["decode"].nodes, roles["prefill"].nodes) == (16, 8, 4)
    assert sum(c.nodes for c in plan.components if c.gpus_per_node == 8) == 28
    assert roles["head"].gpus_per_node == 0
    head_services = [s.name for s in roles["head"].services[0]]
    assert head_services[0] == "redis" and "kvstore" in head_services and head_services[-1] == "orchestrator"
    assert [s.name for node in roles["decode"].services for s in node] == [f"decode.{i}" for i in range(8)]
    script = slurm.render_script(cfg, plan)
    blocks = het_blocks(script)
    assert len(blocks) == 4
    for b, c in zip(blocks, plan.components, strict=True):
        assert opt(b, "nodes") == str(c.nodes)
        assert opt(b, "gpus-per-node") == (str(c.gpus_per_node) if c.gpus_per_node else None)
        assert opt(b, "time") == "10080" and opt(b, "exclusive") == "true"
        assert opt(b, "partition") == ("cpu" if c.role == "head" else "h200")
    assert opt(blocks[2], "mem") == "0" and opt(blocks[0], "mem") == "256G"
    assert "--het-group=0,1,2,3" in script
    # torchrun across the 16 trainer nodes: c10d rendezvous, 8 processes per node
    argv = slurm.service_command(
        slurm.ServiceSpec("trainer.3", "trainer", 3), cfg, plan, "redis://h:1/0", 0, "node0:29400", "42"
    )
    assert "--standalone" not in argv
    for a in ("--nnodes=16", "--nproc_per_node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400"):
        assert a in argv
    # services listen on all interfaces in the config they read
    res = slurm.resolved_config(cfg, plan, "redis://h:1/0")
    assert res.decode.host == "0.0.0.0" and res.redis.prefix == plan.prefix
    # every component's module exists now (prefill, kvstore): the job can be submitted
    assert not slurm.missing_modules(plan), slurm.missing_modules(plan)


def test_mooncake_master_listens_on_the_head_only(tmp_path: Path) -> None:
    """The Mooncake master has no authentication (docs/security.md): on Slurm it runs on the head
    beside the one KV store gateway that uses it, bound to loopback, while the gateway itself
    (token-protected) listens on every interface."""
    from services.kvstore.mooncake import master_flags

    cfg = load_config(
        "debug", ["--slurm.launcher=slurm", "--kvstore.enabled=true", "--kvstore.mooncake.enabled=true"]
    )
    plan = slurm.build_plan(cfg, tmp_path / "run")
    head = [s.name for node in plan.components[0].services for s in node]
    assert "mooncake_master" in head and "kvstore" in head
    res = slurm.resolved_config(cfg, plan, "redis://h:1/0")
    assert res.kvstore.host == "0.0.0.0" and res.kvstore.mooncake.master_host == "127.0.0.1"
    argv = master_flags(res.kvstore.mooncake)
    assert "--rpc_address=127.0.0.1" in argv and "--http_metadata_server_host=127.0.0.1" in argv


def test_glm5_model_is_744b_total_40b_active() -> None:
    m = load_config("glm5").model
    p = m.param_counts()
    assert 735e9 < p["total"] < 755e9
    assert 38e9 < p["active"] - p["embedding"] / 2 < 42e9
    assert m.is_moe and m.is_mla and m.max_seq_len == 131072
    sz = slurm.sizing(load_config("glm5"))
    assert 90 < sz["train_state_gb_per_gpu"] < 100  # 16 B/param over 128 GPUs: fits 141 GB with room
    assert 95 < sz["kv_kb_per_token"] < 100


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"n_experts_per_tok": 0}, "n_experts_per_tok"),
        ({"n_experts_per_tok": 300}, "n_experts_per_tok"),
        ({"moe_hidden_dim": 0}, "moe_hidden_dim"),
        ({"head_dim": 128}, "head_dim must equal"),
        ({"index_n_heads": 0}, "indexer"),
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"first_k_dense": 78}, "first_k_dense"),
    ],
)
def test_bad_moe_shapes_are_rejected(change: dict[str, Any], reason: str) -> None:
    base = load_config("glm5").model.model_dump()
    with pytest.raises(ValueError, match=reason):
        ModelConfig.model_validate({**base, **change})


def test_dense_configs_stay_valid_and_reject_mla_fields() -> None:
    m = load_config("debug").model
    assert not m.is_moe and not m.is_mla
    with pytest.raises(ValueError, match="kv_lora_rank"):
        ModelConfig.model_validate({**m.model_dump(), "qk_rope_head_dim": 8})


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (["--decode.replicas=3", "--slurm.decode.nodes=2"], "do not divide evenly"),
        (["--trainer.nproc=3", "--slurm.trainer.nodes=2"], "multiple of slurm.trainer.nodes"),
        (["--trainer.nproc=4", "--slurm.trainer.gpus_per_node=8"], "one process per GPU"),
        (["--decode.replicas=3", "--slurm.decode.gpus_per_node=8"], "cannot split 8 GPUs"),
    ],
)
def test_plans_that_cannot_be_laid_out_fail_with_the_reason(
    overrides: list[str], reason: str, tmp_path: Path
) -> None:
    cfg = load_config("debug", ["--slurm.launcher=slurm", *overrides])
    with pytest.raises(ConfigError, match=reason):
        slurm.build_plan(cfg, tmp_path)


def test_partial_component_override_keeps_prefill_off() -> None:
    cfg = load_config("debug", ["--slurm.prefill.mem=8G", "--slurm.decode.mem=8G"])
    assert cfg.slurm.prefill.nodes == 0 and cfg.slurm.prefill.mem == "8G"
    assert cfg.slurm.decode.nodes == 1


def test_slurm_section_validation() -> None:
    with pytest.raises(ConfigError, match="slurm.head.nodes must be 1"):
        load_config("debug", ["--slurm.head.nodes=2"])
    with pytest.raises(ConfigError, match="not a Slurm time"):
        load_config("debug", ["--slurm.time=tomorrow"])
    with pytest.raises(ConfigError, match="slurm.launcher"):
        load_config("debug", ["--slurm.launcher=k8s"])
    assert load_config("debug", ["--slurm.time=90"]).slurm.time == "90"
    assert [slurm_time_minutes(t) for t in ("30", "1:30", "04:00:00", "7-00:00:00", "2-12")] == [
        30,
        2,
        240,
        10080,
        3600,
    ]


def test_several_decode_replicas_per_node_split_the_gpus(tmp_path: Path) -> None:
    cfg = load_config(
        "debug",
        [
            "--slurm.launcher=slurm",
            "--decode.replicas=4",
            "--slurm.decode.nodes=2",
            "--slurm.decode.gpus_per_node=8",
            "--decode.parallel.tp=4",  # one rank per GPU of the replica
        ],
    )
    decode = slurm.build_plan(cfg, tmp_path).component("decode")
    assert decode is not None
    assert [[(s.name, s.gpus) for s in node] for node in decode.services] == [
        [("decode.0", "0,1,2,3"), ("decode.1", "4,5,6,7")],
        [("decode.2", "0,1,2,3"), ("decode.3", "4,5,6,7")],
    ]


def test_a_decode_engine_over_two_nodes_runs_a_node_host_on_the_second(tmp_path: Path) -> None:
    """One decode replica on 2 nodes with tp 2 (CPU: 1 rank per node): the service (rank 0) on the
    first node, a node host of rank 1 on the second, meeting at rank 0's rendezvous in Redis."""
    cfg = load_config("debug", [*SMALL, "--slurm.decode.nodes=2", "--decode.parallel.tp=2"])
    assert cfg.engine_nodes("decode") == 2 and cfg.engine_nodes("prefill") == 1
    plan = slurm.build_plan(cfg, tmp_path)
    decode = plan.component("decode")
    assert decode is not None and decode.nodes == 2
    assert decode.services == (
        (slurm.ServiceSpec("decode.0", "decode", 0),),
        (slurm.ServiceSpec("decode.0.node1", "engine_ranks", 0, node=1),),
    )
    url = "redis://h:1/0"
    argv = slurm.service_command(decode.services[1][0], cfg, plan, url)
    assert argv[1:] == [
        "-m", "services.engine.parallel.node", "--config", plan.config_path, "--redis-url", url,
        "--role", "decode", "--index", "0", "--node", "1",
    ]  # fmt: skip
    assert slurm.service_command(decode.services[0][0], cfg, plan, url)[1:3] == ["-m", "services.decode"]
    text = slurm.describe(cfg, plan)
    assert "node 1: decode.0.node1" in text and "decode.0.node1: " in text
    assert "each over 2 nodes, 1 rank(s) per node as processes" in text
    assert slurm.missing_modules(plan) == []
    script = slurm.render_script(cfg, plan)
    decode_block = het_blocks(script)[1]  # one task per node: its supervisors (sbatch/slurm.py)
    assert opt(decode_block, "nodes") == "2" and opt(decode_block, "ntasks-per-node") == "1"
    assert [line for line in script.splitlines() if line.startswith("srun ")][0].count("--het-group=0,1,2")


def test_glm5_decode_engines_over_four_nodes_each(tmp_path: Path) -> None:
    """GLM-5's 8 decode nodes as 2 engines of EP 32 (8 GPUs a node): a node host on 3 of each
    engine's 4 nodes, every node's GPUs visible to its task."""
    over = ["--decode.replicas=2", "--decode.parallel.dp_attention=32", "--decode.parallel.ep=32"]
    cfg = load_config("glm5", over)
    decode = slurm.build_plan(cfg, tmp_path).component("decode")
    assert decode is not None
    assert [[(s.name, s.kind, s.node, s.gpus) for s in n] for n in decode.services] == [
        [(f"decode.{i}", "decode", 0, "")] if j == 0 else [(f"decode.{i}.node{j}", "engine_ranks", j, "")]
        for i in range(2)
        for j in range(4)
    ]
    with pytest.raises(ConfigError, match=r"decode.parallel: tp x dp_attention = 16 .* gets 32 GPU"):
        load_config(
            "glm5", ["--decode.replicas=2", "--decode.parallel.dp_attention=16", "--decode.parallel.ep=16"]
        )


def test_an_engine_whose_ranks_do_not_split_over_its_nodes_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"decode.parallel: .* 2 rank\(s\) per engine cannot split evenly"):
        load_config("debug", ["--slurm.launcher=slurm", "--slurm.decode.nodes=4", "--decode.parallel.tp=2"])
    with pytest.raises(ConfigError, match="2 replicas cannot span 3 nodes"):
        slurm.build_plan(
            load_config("debug", ["--slurm.launcher=slurm", "--decode.replicas=2", "--slurm.decode.nodes=3"]),
            Path("/nonexistent"),
        )


def test_het_position_from_srun_environment() -> None:
    env = {"SLURM_NTASKS_HET_GROUP_0": "1", "SLURM_NTASKS_HET_GROUP_1": "2", "SLURM_NTASKS_HET_GROUP_2": "3"}
    got = [slurm.het_position({**env, "SLURM_PROCID": str(p)}) for p in range(6)]
    assert got == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    assert slurm.het_position({"SLURM_PROCID": "2"}) == (0, 2)  # a plain (non-het) job
    with pytest.raises(RuntimeError):
        slurm.het_position({**env, "SLURM_PROCID": "6"})


# ---------------------------------------------------------------------- on the test cluster


def probe(plan: slurm.JobPlan) -> dict[str, Any]:
    """What every task of the probe job reports: the component it found itself in."""
    group, rank = slurm.het_position(os.environ)
    return {
        "group": group,
        "rank": rank,
        "role": plan.components[group].role,
        "node": os.environ.get("SLURMD_NODENAME"),
        "procid": int(os.environ["SLURM_PROCID"]),
    }


def test_het_job_tasks_learn_their_component(slurm_cluster: str, tmp_path: Path) -> None:
    """The launcher's own het-job script (through submitit), with a probe in place of the services:
    every task lands in its component, one node each, and reports back."""
    import cloudpickle
    import submitit

    # The job cannot import this test module: ship `probe` by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = load_config("debug", [*SMALL, "--slurm.trainer.nodes=2", "--trainer.nproc=2"])
    plan = slurm.build_plan(cfg, tmp_path / "run")
    folder = slurm.submitit_folder(cfg, tmp_path / "run")
    ex = submitit.SlurmExecutor(folder=folder)
    ex.update_parameters(**slurm.sbatch_parameters(cfg, plan))
    t0 = time.monotonic()
    job = ex.submit(probe, plan)
    assert (folder / f"{job.job_id}_submission.sh").read_text() == slurm.render_script(cfg, plan).replace(
        str(sys.executable), ex.python
    ), "the dry run must show exactly what is submitted"
    n = sum(c.nodes for c in plan.components)
    assert n == 4
    every = submitit.SlurmJob(folder=folder, job_id=job.job_id, tasks=tuple(range(n)))
    try:
        while not all((folder / f"{job.job_id}_{i}_result.pkl").exists() for i in range(n)):
            assert time.monotonic() - t0 < 120, (
                f"het job {job.job_id} did not finish: {slurm.job_states(job.job_id)}"
            )
            time.sleep(0.2)
    finally:
        subprocess.run(["scancel", job.job_id], check=False)
    took = time.monotonic() - t0
    results = sorted((every.task(i).result() for i in range(n)), key=lambda r: r["procid"])
    assert [(r["role"], r["rank"]) for r in results] == [
        ("head", 0),
        ("decode", 0),
        ("trainer", 0),
        ("trainer", 1),
    ]
    assert len({r["node"] for r in results}) == n, "each task should have its own (virtual) node"
    print(f"het job {job.job_id}: {n} tasks done {took:.1f}s after submission")


def test_glm5_script_passes_sbatch_test_only(slurm_cluster: str, tmp_path: Path) -> None:
    """The rendered GLM-5 script is a valid het job for Slurm: checked against the test cluster's fake
    H200 partition (CLOUD nodes with 8 GPUs each)."""
    cfg = load_config(
        "glm5", ["--slurm.partition=gpu", "--slurm.head.partition=gpu", f"--run.dir={tmp_path}"]
    )
    script = tmp_path / "job.sh"
    script.write_text(slurm.render_script(cfg, slurm.build_plan(cfg, tmp_path)))
    out = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "to start at" in out.stderr
    # and Slurm does reject what cannot fit (9 GPUs per node)
    cfg = load_config(
        "glm5",
        [
            "--slurm.partition=gpu",
            "--slurm.head.partition=gpu",
            "--slurm.trainer.gpus_per_node=9",
            "--trainer.nproc=144",
        ],
    )
    script.write_text(slurm.render_script(cfg, slurm.build_plan(cfg, tmp_path)))
    out = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0


def test_cluster_script_is_idempotent(slurm_cluster: str) -> None:
    t0 = time.monotonic()
    out = subprocess.run(
        ["bash", str(REPO_ROOT / "sbatch" / "cluster.sh"), "start"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "already running" in out.stderr
    assert time.monotonic() - t0 < 10
    info = subprocess.run(
        ["sinfo", "-h", "-p", "debug", "-o", "%D %t"], capture_output=True, text=True, check=True
    )
    # every virtual node up: not powered down ("idle~"), down, drained or unresponsive ("*"). A
    # trailing "-" only says the backfill scheduler has planned the node for a pending job ("mix-"
    # while another test's job still holds part of it): the node is up.
    rows = [line.split() for line in info.stdout.splitlines()]
    assert sum(int(n) for n, _ in rows) == int(os.environ.get("RELAY_SLURM_NODES", "4"))
    states = [state.removesuffix("-") for _, state in rows]
    assert all(state in ("idle", "plnd", "mix", "alloc", "comp") for state in states), rows


def test_refused_submission_names_the_reason(slurm_cluster: str, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sbatch.launch", "run", "debug", *SMALL, f"--run.dir={tmp_path / 'run'}"]
        + ["--slurm.partition=nosuch"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "sbatch refused the job" in out.stdout and "invalid partition" in out.stdout.lower()


def test_the_local_launcher_gives_each_multi_rank_replica_its_gpus() -> None:
    """Locally, replica i of an engine with several ranks sees GPUs [i x ranks, (i + 1) x ranks);
    one-rank replicas and CPU engines see what they always did."""
    from sbatch.local import LocalRun

    cfg = load_config(
        "debug", ["--decode.parallel.tp=2", "--decode.replicas=2", "--decode.engine.device=cuda"]
    )
    assert [n for n, _ in LocalRun.describe(cfg) if n.startswith("decode")] == [
        "decode.0 [gpus 0,1]",
        "decode.1 [gpus 2,3]",
    ]
    for over in (["--decode.parallel.tp=2", "--decode.replicas=2"], ["--decode.replicas=2"]):
        names = [n for n, _ in LocalRun.describe(load_config("debug", over)) if n.startswith("decode")]
        assert names == ["decode.0", "decode.1"]  # debug's engine is on the CPU; or one rank each
    out = subprocess.run(
        [sys.executable, "-m", "sbatch.launch", "run", "debug", "--decode.parallel.tp=2", "--dry-run"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "each decode.i is rank 0 of an engine of 2 ranks (tp 2" in out
