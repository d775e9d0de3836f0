import pytest

from services.common.config import ConfigError, load_config, parse_overrides


def test_debug_config_loads_with_model_arch():
    cfg = load_config("debug")
    assert cfg.model.dim == 64 and cfg.model.n_kv_heads == 2
    assert {t.env for t in cfg.orchestrator.tasks} == {"reverse", "reverse-turns"}


def test_dotted_overrides_are_toml_values():
    cfg = load_config("debug", ["--orchestrator.batch_size=64", "--trainer.betas=[0.8, 0.9]", "--run.name=x"])
    assert cfg.orchestrator.batch_size == 64
    assert cfg.trainer.betas == (0.8, 0.9)
    assert cfg.run.name == "x"
    assert parse_overrides(["--a.b.c=true"]) == {"a": {"b": {"c": True}}}


@pytest.mark.parametrize(
    ("override", "key", "reason"),
    [
        (["--orchestrator.batchsize=64"], "orchestrator.batchsize", "unknown key"),
        (["--trainer.lr=abc"], "trainer.lr", "valid number"),
        (["--orchestrator.group_size=1"], "orchestrator.group_size", "greater than 1"),
        (["--model.n_heads=3"], "model", "multiple of n_kv_heads"),
        (["--orchestrator.advantage_std_norm=true"], "advantage_std_norm", "advantage = 'token'"),
        (["--orchestrator.baseline_prior=-1"], "orchestrator.baseline_prior", "greater than or equal"),
        (
            [
                "--orchestrator.advantage=sequence",
                "--orchestrator.advantage_std_norm=true",
                "--orchestrator.baseline_prior=2",
            ],
            "baseline_prior",
            "advantage_std_norm",
        ),
    ],
)
def test_bad_values_name_the_key(override, key, reason):
    with pytest.raises(ConfigError) as e:
        load_config("debug", override)
    assert key in str(e.value) and reason in str(e.value)


def test_bad_files_fail_fast(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nname = 1")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(str(bad))
    wrong = tmp_path / "wrong.toml"
    wrong.write_text("[trainer]\nlr = -1\n")
    with pytest.raises(ConfigError, match="trainer.lr"):
        load_config(str(wrong))


def test_malformed_override_is_rejected():
    with pytest.raises(ConfigError, match="expected --section.key=value"):
        load_config("debug", ["orchestrator.batch_size=3"])


def test_base_config_is_merged_under_the_derived_one(tmp_path) -> None:
    derived = tmp_path / "derived.toml"
    derived.write_text('base = "debug"\n[run]\nname = "derived"\n[trainer]\nlr = 1e-4\n')
    cfg, base = load_config(str(derived)), load_config("debug")
    assert cfg.run.name == "derived" and cfg.trainer.lr == 1e-4
    # everything else comes from the base, tables merged key by key
    assert cfg.orchestrator == base.orchestrator and cfg.trainer.entropy_target == base.trainer.entropy_target
    assert load_config("debug-moe").model.arch == "qwen3_moe"

    loop = tmp_path / "loop.toml"
    loop.write_text(f'base = "{loop}"\n')
    with pytest.raises(ConfigError, match="cycle"):
        load_config(str(loop))
    bad = tmp_path / "bad.toml"
    bad.write_text("base = 3\n")
    with pytest.raises(ConfigError, match="base must be"):
        load_config(str(bad))


def test_decode_step_budget_is_small_when_prefill_services_exist() -> None:
    from services.common.config import DISAGG_DECODE_STEP_TOKENS, RunConfig

    assert RunConfig().decode.engine.max_num_batched_tokens == 8192  # colocated: unchanged
    for with_prefill in ({"prefill": {"replicas": 1}}, {"slurm": {"prefill": {"nodes": 2}}}):
        cfg = RunConfig.model_validate(with_prefill)
        assert cfg.decode.engine.max_num_batched_tokens == DISAGG_DECODE_STEP_TOKENS == 512
        # What the launcher writes is what every service reads back.
        assert RunConfig.model_validate_json(cfg.dump()).decode.engine.max_num_batched_tokens == 512
    # Set by the user: kept. A batch of decodes always fits a step.
    set_ = {"prefill": {"replicas": 1}, "decode": {"engine": {"max_num_batched_tokens": 4096}}}
    assert RunConfig.model_validate(set_).decode.engine.max_num_batched_tokens == 4096
    big = {"prefill": {"replicas": 1}, "decode": {"engine": {"max_batch_size": 1024}}}
    assert RunConfig.model_validate(big).decode.engine.max_num_batched_tokens == 1024
