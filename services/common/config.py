"""Run configuration: TOML files under configs/ plus dotted command-line overrides.

A run file (configs/<name>.toml) names a model architecture (configs/models/<arch>.toml) and
sets every service's knobs. `--orchestrator.batch_size=64` style overrides are parsed as TOML
values, applied on top, and the whole tree is validated by pydantic with `extra="forbid"`, so a
typo fails at start with the dotted key that was wrong and why.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "configs"


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and the reason."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Strict):
    """A Qwen3/Llama-style decoder. Field names follow HF config.json semantics."""

    arch: Literal["qwen3"] = "qwen3"
    vocab_size: int = Field(64, gt=0)
    dim: int = Field(64, gt=0)
    n_layers: int = Field(2, gt=0)
    n_heads: int = Field(4, gt=0)
    n_kv_heads: int = Field(4, gt=0)
    head_dim: int = Field(16, gt=0)
    hidden_dim: int = Field(256, gt=0)
    max_seq_len: int = Field(256, gt=0)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    qk_norm: bool = True
    tie_embeddings: bool = True
    tokenizer: Literal["char"] = "char"

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        return self


class RunSection(Strict):
    name: str = "debug"
    # Empty: runs/<name>-<timestamp>, with runs/latest pointing at it.
    dir: str = ""
    seed: int = 0
    max_steps: int = Field(120, gt=0)
    # Stop early once every task's 10-step mean reward has reached its target.
    stop_on_targets: bool = False
    timeout_s: float = Field(900.0, gt=0)


class RedisSection(Strict):
    # Empty: the launcher starts a bundled server on a free port.
    url: str = ""
    prefix: str = "relay"
    heartbeat_s: float = Field(1.0, gt=0)
    ttl_s: float = Field(5.0, gt=0)


class ServiceSection(Strict):
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)  # 0: pick a free port
    replicas: int = Field(1, ge=1)


class EngineConfig(Strict):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_batch_size: int = Field(256, gt=0)
    max_seq_len: int = Field(256, gt=0)
    torch_threads: int = Field(1, ge=1)


class DecodeSection(ServiceSection):
    engine: EngineConfig = EngineConfig()


class SandboxSection(ServiceSection):
    session_ttl_s: float = Field(300.0, gt=0)
    max_sessions: int = Field(4096, gt=0)
    # Extra modules that register environments (plugins), imported at start.
    plugins: list[str] = []


class TaskSpec(Strict):
    env: str
    weight: float = Field(1.0, gt=0)
    # Reward the run aims for on this task; reported in the summary.
    target: float = Field(0.0, ge=0.0, le=1.0)


class SamplingConfig(Strict):
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_tokens: int = Field(8, gt=0)


class OrchestratorSection(ServiceSection):
    # Rollout groups (prompts) per trainer step; each group has group_size samples.
    batch_size: int = Field(32, gt=0)
    group_size: int = Field(8, gt=1)
    max_off_policy_steps: int = Field(1, ge=0)
    # Upper bound on concurrently running groups (the staleness bound is usually tighter).
    max_inflight_groups: int = Field(64, gt=0)
    max_turns: int = Field(8, gt=0)
    request_timeout_s: float = Field(60.0, gt=0)
    tasks: list[TaskSpec] = [TaskSpec(env="reverse")]
    sampling: SamplingConfig = SamplingConfig()


class TrainerSection(Strict):
    nproc: int = Field(1, ge=1)
    lr: float = Field(1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    # Tokens whose importance ratio pi_train/pi_infer falls outside [ratio_low, ratio_high]
    # are masked out of the loss (see docs/loss.md).
    ratio_low: float = Field(0.5, gt=0)
    ratio_high: float = Field(2.0, gt=1)
    checkpoint_every: int = Field(20, gt=0)
    init_std: float = Field(0.02, gt=0)
    torch_threads: int = Field(1, ge=1)
    # Padded tokens (rows x longest row) per forward/backward; a step is split into micro-batches.
    micro_batch_tokens: int = Field(8192, gt=0)


class RunConfig(Strict):
    run: RunSection = RunSection()
    model: ModelConfig = ModelConfig()
    redis: RedisSection = RedisSection()
    decode: DecodeSection = DecodeSection()
    sandbox: SandboxSection = SandboxSection()
    orchestrator: OrchestratorSection = OrchestratorSection()
    trainer: TrainerSection = TrainerSection()

    def dump(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True)


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`--a.b=3 --c.d="x"` -> {"a": {"b": 3}, "c": {"d": "x"}}; values are TOML, bare words are strings."""
    tree: dict[str, Any] = {}
    for arg in args:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"override {arg!r}: expected --section.key=value")
        key, raw = arg[2:].split("=", 1)
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {arg!r}: {part} is not a section")
        node[parts[-1]] = value
    return tree


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None


def _format_validation(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  {key}: {msg} (got {e.get('input')!r})")
    return "\n".join(lines)


def load_config(name_or_path: str, overrides: list[str] | None = None) -> RunConfig:
    """Load configs/<name>.toml (or a path), resolve its model architecture, apply overrides."""
    path = Path(name_or_path)
    if not path.suffix:
        path = CONFIG_DIR / f"{name_or_path}.toml"
    tree = _read_toml(path)
    tree = _merge(tree, parse_overrides(overrides or []))
    model = tree.get("model", {})
    if isinstance(model, dict) and "config" in model:
        arch_path = CONFIG_DIR / "models" / f"{model.pop('config')}.toml"
        tree["model"] = _merge(_read_toml(arch_path), model)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, str(path))) from None


def load_resolved(path: str | Path) -> RunConfig:
    """Services read the launcher's resolved JSON config (RUN_DIR/config.json)."""
    try:
        return RunConfig.model_validate_json(Path(path).read_text())
    except ValidationError as e:
        raise ConfigError(_format_validation(e, str(path))) from None
