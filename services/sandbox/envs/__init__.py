"""Environments: the interface and registry (base) plus the built-in toy tasks, which register
themselves on import."""

from services.sandbox.envs import (  # noqa: F401 - imported to register
    echo,
    guess,
    reverse,
    reverse_tools,
    swe_lite,
    swe_real,
)
from services.sandbox.envs.base import (
    EnvError,
    Environment,
    env_names,
    get_env_class,
    load_plugins,
    make_env,
    normalize_score,
    positional_score,
    register_env,
)

__all__ = [
    "EnvError",
    "Environment",
    "env_names",
    "get_env_class",
    "load_plugins",
    "make_env",
    "normalize_score",
    "positional_score",
    "register_env",
]
