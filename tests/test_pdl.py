"""Programmatic Dependent Launch (ops/pdl.py, EngineConfig.pdl): what can be
checked without a Hopper GPU.

- the config field and its dotted override;
- the switch resolves off on CPU and under TRITON_INTERPRET, however it is asked for;
- the scope is per thread / per context and nests;
- every kernel launcher asks pdl.launch: under the interpreter a kernel compiled with USE_GDC
  True fails (`gdc_wait` has no interpreter implementation), so running every kernel of the decode
  step inside pdl.scope(True) on CPU, and getting the torch reference's results bit for bit equal
  to the same launch outside the scope, shows that none of them bypasses the "usable here" check;
- the whole engine (triton backend, fused kernels, fused sampler) with its PDL switch forced on
  gives exactly the tokens and log-probs of one with it off;
- the hazard rule, statically, for every Triton kernel the engine's GPU path launches: each takes
  USE_GDC, its launch passes the same value as launch_pdl, it waits before its first store and
  before any return, loads only weights / step metadata before the wait, and lets dependents
  launch after the wait. A kernel added later without these fails here.
On the H200 the same switch is measured and checked end to end by bench/engine/profile_batch1.py
--compare pdl (bitwise-equal greedy tokens and logits with PDL off and on)."""

from __future__ import annotations

import ast
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from helpers import triton_interp

INTERPRET, IN_CHILD, needs_interpreter, triton_interpreter, test_pdl_kernel_tests_in_child_process = (
    triton_interp.kernel_test_module(
        ("sampling", "ops.fused_norm", "paged_attention", "qk_rope", "gemv"), __file__
    )
)
# These run CPU tensors under the interpreter (on a GPU host the H200 bench checks the real thing).
needs_interpreter = pytest.mark.skipif(
    IN_CHILD or not INTERPRET, reason=triton_interp.CHILD_REASON if IN_CHILD else "no interpreter with CUDA"
)


from pydantic import ValidationError  # noqa: E402

from ops import fused_norm, pdl  # noqa: E402
from services.common.config import ConfigError, EngineConfig, load_config  # noqa: E402
from services.common.modeldir import hf_config  # noqa: E402
from services.common.schemas import GenerateRequest, SamplingParams  # noqa: E402
from services.common.weights_dir import write_model_dir  # noqa: E402
from services.engine import LLMEngine  # noqa: E402
from services.engine.batch import HostBatch, Span  # noqa: E402
from services.engine.kernels import gemv, paged_attention, qk_rope, sampling  # noqa: E402
from services.engine.layers.rope import apply_rope, rope_cache  # noqa: E402
from services.engine.layers.sampler import Sampler  # noqa: E402
from services.engine.models.causal_lm import CausalLM  # noqa: E402

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- the switch


def test_config_field_defaults_on_and_validates() -> None:
    assert EngineConfig().pdl is True
    assert EngineConfig(pdl=False).pdl is False
    with pytest.raises(ValidationError, match="pdl"):
        EngineConfig(pdl="sometimes")  # type: ignore[arg-type]
    assert load_config("debug", ["--decode.engine.pdl=false"]).decode.engine.pdl is False
    with pytest.raises(ConfigError, match=r"decode\.engine\.pdl"):
        load_config("debug", ['--decode.engine.pdl="sometimes"'])


def test_resolves_off_on_cpu_and_under_the_interpreter() -> None:
    cpu = torch.device("cpu")
    assert pdl.resolve(True, cpu) is False and pdl.usable(cpu) is False
    assert pdl.resolve(False, cpu) is False
    saved = triton_interp.set_interpret("1")
    try:
        assert pdl.interpreting()
        # Decided before any CUDA query: the interpreter runs kernels on CPU, whatever the device.
        assert pdl.usable(torch.device("cuda")) is False
        assert pdl.resolve(True, torch.device("cuda")) is False
    finally:
        triton_interp.set_interpret(saved)
    if not torch.cuda.is_available():
        assert pdl.resolve(True, torch.device("cuda")) is False
    elif not pdl.interpreting():
        hopper = torch.cuda.get_device_capability()[0] >= 9
        assert pdl.resolve(True, torch.device("cuda")) is hopper


def test_scope_nests_and_stays_in_its_thread() -> None:
    assert pdl.active() is False
    seen: list[bool] = []
    with pdl.scope(True):
        assert pdl.active() is True
        with pdl.scope(False):
            assert pdl.active() is False
        assert pdl.active() is True
        # A CPU tensor never launches with PDL, inside any scope.
        assert pdl.launch(torch.zeros(1)) is False
        # Another thread (another engine's stepping thread) does not inherit this one's setting.
        t = threading.Thread(target=lambda: seen.append(pdl.active()))
        t.start()
        t.join()
    assert seen == [False]
    assert pdl.active() is False


def _tiny_model_dir(tmp_path: Path, seed: int) -> Path:
    m = load_config("debug").model
    torch.manual_seed(seed)
    state = {k: v for k, v in CausalLM(m, m.max_seq_len).state_dict().items() if "rope" not in k}
    return write_model_dir(tmp_path / "step_0", state, hf_config(m, eos_token_id=0), None, {"version": 0})


def test_engine_resolves_the_switch_for_its_device(tmp_path: Path) -> None:
    path = _tiny_model_dir(tmp_path, 0)
    engine = LLMEngine(path, EngineConfig(device="cpu", max_batch_size=4, max_seq_len=32, pdl=True))
    # Asked for, not usable on CPU: off for the model's forwards and the sampler alike.
    assert engine.pdl is False and engine.model.pdl is False and engine.sampler.pdl is False


# ----------------------------------------------------------------------------- kernels in a PDL scope


def _both(fn: Callable[[], T]) -> tuple[T, T]:
    """fn() outside any scope and inside pdl.scope(True) (where a launcher that passed USE_GDC
    True would fail under the interpreter)."""
    plain = fn()
    with pdl.scope(True):
        scoped = fn()
    return plain, scoped


@needs_interpreter
def test_decode_step_kernels_inside_a_pdl_scope_compute_the_same_function() -> None:
    g = torch.Generator().manual_seed(7)
    # GEMV: K = 700 runs three 256-wide K tiles (the first one loaded before the PDL wait).
    x, w = torch.randn(3, 700, generator=g), torch.randn(40, 700, generator=g)
    for cfg in gemv.CONFIGS:
        a, b = _both(lambda cfg=cfg: gemv.gemv(x, w, cfg))
        assert torch.equal(a, b), cfg
        torch.testing.assert_close(a, torch.nn.functional.linear(x, w), atol=1e-4, rtol=1e-5)

    # Residual add + RMSNorm, SiLU-mul.
    h0, d0, nw = torch.randn(4, 96, generator=g), torch.randn(4, 96, generator=g), torch.rand(96, generator=g)
    (h1, y1), (h2, y2) = _both(lambda: fused_norm.add_rms_norm(h0, d0, nw, 1e-6))
    assert torch.equal(h1, h2) and torch.equal(y1, y2)
    torch.testing.assert_close(h1, h0 + d0)
    torch.testing.assert_close(
        y1, torch.nn.functional.rms_norm(h0 + d0, (96,), nw, 1e-6), atol=1e-5, rtol=1e-5
    )
    gate, up = torch.randn(4, 80, generator=g), torch.randn(4, 80, generator=g)
    a, b = _both(lambda: fused_norm.silu_mul(gate, up))
    assert torch.equal(a, b)
    torch.testing.assert_close(a, torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)

    # q/k norm + RoPE + KV store (slot -1 stores nothing).
    t, nh, nkv, d = 3, 4, 2, 16
    cos_t, sin_t = rope_cache(d, 32, 10000.0)
    pos = torch.tensor([0, 9, 31])
    qkv = torch.randn(t, (nh + 2 * nkv) * d, generator=g)
    q = qkv[:, : nh * d].view(t, nh, d)
    k = qkv[:, nh * d : (nh + nkv) * d].view(t, nkv, d)
    v = qkv[:, (nh + nkv) * d :].view(t, nkv, d)
    slots = torch.tensor([5, -1, 2])
    caches = []

    def rope() -> torch.Tensor:
        kc, vc = torch.zeros(8, nkv, d), torch.zeros(8, nkv, d)
        caches.append((kc, vc))
        return qk_rope.qk_rope_store(q, k, v, cos_t[pos], sin_t[pos], None, None, 0.0, kc, vc, slots)

    a, b = _both(rope)
    assert torch.equal(a, b) and all(torch.equal(x0, x1) for x0, x1 in zip(*caches, strict=True))
    torch.testing.assert_close(a, apply_rope(q, cos_t[pos], sin_t[pos]), atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[0][1][slots[slots >= 0]], v[slots >= 0])

    # Paged attention: decodes split over partitions (decode + merge kernels) next to a prefill.
    page, h, h_kv, hd = 4, 4, 2, 16
    # A 151-key decode (several 64-key partitions on 64 SMs), a 5-token prompt, a short decode.
    spans = [Span(list(range(38)), 150, [1]), Span([38, 39], 0, [1, 2, 3, 4, 5]), Span([40, 41, 42], 9, [1])]
    hb = HostBatch.build(spans, page)
    fb = hb.to_forward_batch(torch.device("cpu"), h_kv, 64)
    assert fb.paged is not None and fb.paged.decode is not None and fb.paged.decode.work is not None
    assert fb.paged.prefill is not None
    kc0, vc0 = torch.randn(43 * page, h_kv, hd, generator=g), torch.randn(43 * page, h_kv, hd, generator=g)
    qa = torch.randn(len(hb.ids), h, hd, generator=g)
    ka, va = torch.randn(len(hb.ids), h_kv, hd, generator=g), torch.randn(len(hb.ids), h_kv, hd, generator=g)
    pools = []

    def attention() -> torch.Tensor:
        kc, vc = kc0.clone(), vc0.clone()
        pools.append((kc, vc))
        return paged_attention.paged_attention(qa, ka, va, kc, vc, fb.slot_mapping, fb.paged, hd**-0.5, page)  # type: ignore[arg-type]

    a, b = _both(attention)
    assert torch.equal(a, b) and all(torch.equal(x0, x1) for x0, x1 in zip(*pools, strict=True))
    kc, vc = pools[0]
    assert torch.equal(kc[fb.slot_mapping], ka) and torch.equal(vc[fb.slot_mapping], va)
    tables = [s.block_table for s in spans]
    want = paged_attention.reference_attention(
        qa, kc, vc, hb.q_start.tolist(), hb.q_lens.tolist(), hb.ctx_lens.tolist(), tables, hd**-0.5, page
    )
    torch.testing.assert_close(a, want, atol=1e-5, rtol=1e-5)

    # The fused sampler (chunk + merge kernels): greedy rows and seeded draws.
    logits = torch.randn(3, 5000, generator=g) * 3
    temps, seeds = torch.tensor([0.0, 1.0, 0.7]), torch.tensor([0, 11, 12])
    (t1, l1), (t2, l2) = _both(lambda: sampling.fused_sample(logits, temps, seeds))
    assert torch.equal(t1, t2) and torch.equal(l1, l2)
    assert int(t1[0]) == int(logits[0].argmax())
    assert math.isclose(float(l1[0]), float(torch.log_softmax(logits[0], -1).max()), abs_tol=2e-5)


@needs_interpreter
def test_engine_with_pdl_forced_on_equals_off(tmp_path: Path) -> None:
    """The GPU path's kernels (triton backend, fused elementwise kernels and projections, fused
    sampler) with the engine's PDL switch forced on, as resolve() would set it on an H200: the
    launchers still decide per device (CPU: off), so tokens and log-probs are those of PDL off,
    exactly, through chunked prefill and decode steps."""
    path = _tiny_model_dir(tmp_path, 3)
    base = dict(device="cpu", max_batch_size=4, max_seq_len=64, block_size=4, max_num_batched_tokens=16)
    reqs = [
        GenerateRequest(
            input_ids=list(range(3, 3 + n)),
            sampling=SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=4, seed=i, ignore_eos=True),
        )
        for i, n in enumerate((5, 21, 2))
    ]
    outs = []
    for on in (False, True):
        engine = LLMEngine(path, EngineConfig(**base, attention_backend="triton", pdl=on))  # type: ignore[arg-type]
        engine.model.fused_elementwise = True  # what the engine sets on CUDA
        engine.model.fuse_projections()
        engine.model.pdl = on  # forced: resolve() says off on CPU
        engine.sampler = Sampler(fused=True, pdl=on)
        # The forward's scope is what the kernel launchers inside the layers see.
        seen: list[bool] = []
        attn = engine.model.model.layers[0].self_attn
        handle = attn.register_forward_pre_hook(lambda *_, seen=seen: seen.append(pdl.active()))
        outs.append(engine.generate(reqs))
        handle.remove()
        assert seen and set(seen) == {on}
    for a, b in zip(*outs, strict=True):
        assert a.choices[0].output_ids == b.choices[0].output_ids
        assert a.choices[0].logprobs == b.choices[0].logprobs


# ----------------------------------------------------------------------------- the hazard rule

# Loads allowed before gdc_wait, per kernel: weights (no kernel of the forward writes them) and
# step metadata the host copies in before the forward's first kernel (ops/pdl.py).
# The decode kernels' step metadata, read by their shared work-item prologue (_decode_item).
DECODE_ITEM_PTRS = {
    "ctx_ptr",
    "q_loc_ptr",
    "item_row_ptr",
    "item_qloc_ptr",
    "item_start_ptr",
    "item_end_ptr",
    "item_merge_ptr",
}
PRE_WAIT_LOADS = {
    "_gemv_kernel": {"w_ptr"},
    "_add_rms_norm": {"w_ptr"},
    "_qk_rope_store_kernel": {"qw_ptr", "kw_ptr", "slot_ptr"},
    "_store_kv_kernel": {"slot_ptr"},
    "_decode_kernel": DECODE_ITEM_PTRS,
    "_merge_kernel": {"q_loc_ptr", "row_first_ptr", "row_items_ptr"},
    "_prefill_kernel": {"blk_ptr"},
    "_store_rows_kernel": {"slot_ptr"},
    "_mla_decode_kernel": DECODE_ITEM_PTRS,
    "_index_scores_kernel": {"ctx_ptr", "q_loc_ptr"},
}
ENGINE_KERNEL_MODULES = (
    "services/engine/kernels/gemv.py",
    "ops/fused_norm.py",
    "services/engine/kernels/qk_rope.py",
    "services/engine/kernels/paged_attention.py",
    "services/engine/kernels/mla_decode.py",
    "services/engine/kernels/sampling.py",
    "services/engine/kernels/page_copy.py",
)


def _is_tl_call(node: ast.AST, name: str) -> bool:
    """node is a call of tl.<name> or tl.extra.cuda.<name>."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _pointer_roots(kernel: ast.FunctionDef, expr: ast.AST) -> set[str]:
    """The kernel's pointer arguments (`*_ptr`) an address expression derives from, following
    local assignments (w_rows = w_ptr + ...)."""
    args = {a.arg for a in kernel.args.args}
    derived: dict[str, set[str]] = {}
    for node in ast.walk(kernel):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name in _names(target):
                    derived.setdefault(name, set()).update(_names(node.value))
    roots: set[str] = set()
    todo, seen = list(_names(expr)), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in args:
            roots.add(n)
        else:
            todo.extend(derived.get(n, ()))
    return {r for r in roots if r.endswith("_ptr")}


def _launched_kernels(tree: ast.Module) -> list[tuple[str, ast.Call, ast.FunctionDef]]:
    """(kernel name, its launch call kernel[grid](...), the launching function) in a module."""
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                target = node.func.value
                if isinstance(target, ast.Name):
                    out.append((target.id, node, fn))
    return out


def _helper_load_roots(helper: ast.FunctionDef, call: ast.Call, kernel: ast.FunctionDef) -> set[str]:
    """The kernel's pointer arguments a jit helper called from it loads through: each load's
    roots among the helper's parameters, mapped through the call's arguments to the kernel's."""
    params = [a.arg for a in helper.args.args]
    bound = dict(zip(params, call.args, strict=False)) | {k.arg: k.value for k in call.keywords if k.arg}
    roots: set[str] = set()
    for node in ast.walk(helper):
        if _is_tl_call(node, "load"):
            inner = _pointer_roots(helper, node.args[0])
            assert inner, f"{helper.name}: a load through no pointer parameter"
            for p in inner:
                roots |= _pointer_roots(kernel, bound[p])
    return roots


def test_every_engine_kernel_follows_the_pdl_hazard_rule() -> None:
    checked = set()
    jit: dict[str, ast.FunctionDef] = {}
    trees = {}
    for fname in ENGINE_KERNEL_MODULES:
        trees[fname] = tree = ast.parse((REPO / fname).read_text())
        for f in tree.body:
            if isinstance(f, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in f.decorator_list):
                assert f.name not in jit, f"two jit functions named {f.name}: the check keys them by name"
                jit[f.name] = f
    loading_helpers = {n for n, f in jit.items() if any(_is_tl_call(c, "load") for c in ast.walk(f))}
    for fname, tree in trees.items():
        for name, call, launcher in _launched_kernels(tree):
            kernel = jit[name]
            where = f"{fname}:{name}"
            assert "USE_GDC" in [a.arg for a in kernel.args.args], f"{where} takes no USE_GDC"
            kw = {k.arg: ast.unparse(k.value) for k in call.keywords}
            assert "USE_GDC" in kw and kw.get("launch_pdl") == kw["USE_GDC"], (
                f"{where}: launch_pdl and USE_GDC must be the same value"
            )
            # ... and that value comes from the one place that decides (ops/pdl.py).
            assigns = [
                n
                for n in ast.walk(launcher)
                if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == kw["USE_GDC"]
            ]
            assert assigns and all(ast.unparse(a.value).startswith("pdl.launch(") for a in assigns), where
            waits = [n.lineno for n in ast.walk(kernel) if _is_tl_call(n, "gdc_wait")]
            triggers = [n.lineno for n in ast.walk(kernel) if _is_tl_call(n, "gdc_launch_dependents")]
            assert waits and triggers, f"{where}: needs gdc_wait and gdc_launch_dependents"
            first_wait = min(waits)
            assert min(triggers) > first_wait, f"{where}: dependents launched before the wait"
            for node in ast.walk(kernel):
                line = getattr(node, "lineno", None)
                if line is None or line > first_wait:
                    continue
                assert not _is_tl_call(node, "store"), f"{where}: store before gdc_wait (line {line})"
                assert not isinstance(node, ast.Return), f"{where}: returns before gdc_wait (line {line})"
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in loading_helpers
                ):
                    # A jit helper before the wait may load only what the kernel itself may.
                    helper = jit[node.func.id]
                    assert not any(_is_tl_call(n, "store") for n in ast.walk(helper)), (
                        f"{where}: {node.func.id} stores before gdc_wait"
                    )
                    ptrs = _helper_load_roots(helper, node, kernel)
                    allowed = PRE_WAIT_LOADS.get(name, set())
                    assert ptrs <= allowed, (
                        f"{where}: {node.func.id} loads {ptrs - allowed} before gdc_wait (line {line})"
                    )
                if _is_tl_call(node, "load"):
                    ptrs = _pointer_roots(kernel, node.args[0])
                    allowed = PRE_WAIT_LOADS.get(name, set())
                    assert ptrs and ptrs <= allowed, (
                        f"{where}: loads {ptrs - allowed} before gdc_wait (line {line})"
                    )
            # Every wait sits in the kernel's own body or a branch every program takes before it
            # can return: a return anywhere must come after some wait on its path; the prefill
            # kernel's early return is after the wait of its branch.
            for node in ast.walk(kernel):
                if isinstance(node, ast.Return):
                    assert any(w < node.lineno for w in waits), f"{where}: a return before any wait"
            checked.add(name)
    # The decode step's kernels (models/, layers/, cuda_graphs.py) and the sampler's are all covered.
    assert {
        "_gemv_kernel", "_add_rms_norm", "_silu_mul", "_qk_rope_store_kernel", "_decode_kernel",
        "_merge_kernel", "_prefill_kernel", "_store_kv_kernel", "_sample_chunk", "_sample_combine",
        "_mla_decode_kernel", "_store_rows_kernel", "_index_scores_kernel",
    } <= checked  # fmt: skip


@needs_interpreter
def test_interpreter_rejects_a_gdc_kernel() -> None:
    """Why running the kernels inside pdl.scope(True) on CPU tests something: a kernel launched
    with USE_GDC True cannot run under the interpreter, so a launcher that bypassed pdl.launch
    would fail there."""
    x = torch.randn(2, 64)
    with pytest.raises(Exception, match="_semantic|jit"):
        gemv._gemv_kernel[(1,)](
            x, torch.randn(4, 64), torch.empty(2, 4), 2, 4, 64, 64, 64, 4,
            M_PAD=2, BLOCK_N=4, BLOCK_K=64, USE_GDC=True, launch_pdl=False,
        )  # fmt: skip
