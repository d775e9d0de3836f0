"""Parameter names as the model defines them, whatever wraps it."""

from __future__ import annotations

# Wrappers that prefix parameter names: activation checkpointing and torch.compile.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name
