"""bf16 parameters with float32 master weights for one rank without FSDP (trainer.fsdp = "master").

Megatron-style mixed precision, the world-1 alternative to both FSDP2 on a 1-rank group (which
all-gathers, i.e. copies, every parameter each forward) and float32 parameters under autocast
(which casts every weight to bf16 each forward; the tied 152k x 1024 head once per chunk):

- the model's parameters live in bf16, so the forward runs on them as they are: no casts, no
  copies (the same bf16 GEMM inputs FSDP's MixedPrecisionPolicy gives);
- every parameter has a float32 master; a `register_post_accumulate_grad_hook` adds each
  micro-batch's bf16 gradient into the master's float32 `.grad` (the "main grad") and frees the
  bf16 one, so gradient accumulation over micro-batches is float32, as FSDP's reduce_dtype;
- the optimizer steps on the masters (`optimizer_params`), clipping uses their float32 gradients
  (trainer.parallel.clip_grad_norm), then `sync_params` copies the masters back into the bf16
  parameters (one 6 bytes/parameter pass per step);
- checkpoints hold the masters (`full_state_dict`) and the optimizer state keyed by parameter
  name (`optimizer_state_dict`), the formats get_model_state_dict / get_optimizer_state_dict
  write, so a checkpoint moves between this mode and FSDP2 at any world size.

Buffers keep their dtype (FSDP's MixedPrecisionPolicy does not cast buffers either).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainer.param_names import clean_name

# The optimizer's implementation flags: taken from the optimizer as built (fused on CUDA), not
# from a checkpoint that may have been written on another device.
_IMPL_KEYS = ("fused", "foreach", "capturable", "differentiable")


class MasterWeights:
    """The float32 masters of `model`'s parameters; casts the parameters themselves to `dtype`.

    Build it on the model as loaded (float32, before torch.compile traces it): the masters take
    those exact values, so a resumed run continues from the checkpoint's float32 weights."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
        self.params: list[nn.Parameter] = []
        self.masters: list[nn.Parameter] = []
        self.names: list[str] = []  # state-dict names (wrapper prefixes removed), one per parameter
        self._index: dict[str, int] = {}  # every state-dict name, tied aliases too -> index
        seen: dict[int, int] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            key = clean_name(name)
            if id(p) in seen:  # a tied alias (the output layer sharing the embedding)
                self._index[key] = seen[id(p)]
                continue
            i = seen[id(p)] = len(self.params)
            self._index[key] = i
            self.names.append(key)
            self.params.append(p)
            self.masters.append(nn.Parameter(p.detach().to(torch.float32, copy=True)))
            with torch.no_grad():
                p.data = p.data.to(dtype)  # same Parameter object: tying and hooks stay
            p.register_post_accumulate_grad_hook(self._accumulate_hook(self.masters[i]))

    @staticmethod
    def _accumulate_hook(master: nn.Parameter) -> Any:
        def hook(p: torch.Tensor) -> None:
            g = p.grad
            assert g is not None
            if master.grad is None:
                master.grad = g.to(torch.float32)
            else:
                master.grad.add_(g)  # float32 += bf16: the accumulation is float32
            p.grad = None  # the bf16 gradient is never accumulated into

        return hook

    @torch.no_grad()
    def sync_params(self) -> None:
        """Copy the masters into the bf16 parameters (after each optimizer step)."""
        torch._foreach_copy_(self.params, self.masters)

    # ---------------------------------------------------------- checkpoints

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """model.state_dict() (its keys, wrapper prefixes included) with every parameter replaced
        by its float32 master, on the device, not copied: what the publisher gathers."""
        out = {}
        for key, t in model.state_dict().items():
            i = self._index.get(clean_name(key))
            out[key] = self.masters[i].detach() if i is not None else t
        return out

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """get_model_state_dict's full CPU state with every parameter replaced by its float32
        master (tied aliases too); buffers as they are: what a checkpoint holds."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        for key in sd:
            i = self._index.get(key)
            if i is not None:
                sd[key] = self.masters[i].detach().cpu().clone()
        return sd

    def optimizer_state_dict(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by parameter name, in get_optimizer_state_dict's full format
        ({"state": {name: {...}}, "param_groups": [{..., "params": [name, ...]}]}), on the CPU."""
        native = opt.state_dict()
        pid = {id(m): i for i, m in enumerate(self.masters)}
        # opt.state_dict numbers the parameters in param_groups order; map number -> master.
        order = [pid[id(p)] for g in opt.param_groups for p in g["params"]]
        state = {
            self.names[order[n]]: {
                k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()
            }
            for n, s in native["state"].items()
        }
        groups = [
            {**g, "params": [self.names[order[n]] for n in g["params"]]} for g in native["param_groups"]
        ]
        return {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(self, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
        """Load a state keyed by parameter name (this mode's or FSDP2's full checkpoint)."""
        index = {id(m): i for i, m in enumerate(self.masters)}
        number: dict[str, int] = {}
        for g in opt.param_groups:
            for p in g["params"]:
                if id(p) not in index:
                    raise ValueError("the optimizer holds a tensor that is not a master weight")
                number[self.names[index[id(p)]]] = len(number)
        groups = []
        for saved, live in zip(sd["param_groups"], opt.param_groups, strict=True):
            g = {**saved, "params": [number[name] for name in saved["params"]]}
            g.update({k: live[k] for k in _IMPL_KEYS if k in live})
            groups.append(g)
        state = {number[name]: s for name, s in sd["state"].items()}
        opt.load_state_dict({"state": state, "param_groups": groups})


def masters_of(model: nn.Module) -> MasterWeights | None:
    """The model's MasterWeights (set by trainer.parallel.parallelize), or None."""
    found = model.__dict__.get("relay_masters")
    return found if isinstance(found, MasterWeights) else None


def attach(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> MasterWeights:
    """Give `model` bf16 parameters and float32 masters (a plain attribute, not a submodule:
    the masters are not the model's parameters and stay out of its state dict)."""
    mw = MasterWeights(model, dtype)
    model.__dict__["relay_masters"] = mw
    return mw


def optimizer_params(model: nn.Module) -> list[torch.Tensor]:
    """What the optimizer steps on: the float32 masters in this mode, else the parameters."""
    mw = masters_of(model)
    return list(mw.masters) if mw is not None else list(model.parameters())


def sync_params(model: nn.Module) -> None:
    """After opt.step(): copy the masters into the bf16 parameters (nothing without masters)."""
    mw = masters_of(model)
    if mw is not None:
        mw.sync_params()
