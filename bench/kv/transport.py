"""Micro-benchmark of the KV page transport: put/get throughput (MB/s) against the real gateway.

Starts Redis and the KV store gateway (RAM tier) as processes, then times, for batches of
`--pages` pages of `--page-tokens` x `--token-bytes` (default: 64 pages of 16 tokens of Qwen3-0.6B's
112 KiB per token, 1.75 MiB a page, 112 MiB a batch):

  put     KVStoreClient.put (what PagePublisher does with a finished sequence's pages)
  get     KVStoreClient.get_prefix (what decode does before admitting a prompt)
  import  kv_transfer.import_pages of the pulled bytes into a KVCache of that layout on --device
          (the copy the engine's step thread pays), reported separately and as get+import

`--paths legacy` runs a plain data path as the baseline (the client over the gateway's HTTP routes:
httpx, one response body read into bytes, a bytes copy per page and a join, put copying its chunk
into a new frame; a plain import: a join copy, a contiguous copy per pool, one indexed write)
against the same gateway in the same process. `http` is relay's client forced onto the HTTP
routes, `client` relay's client (the data plane, reused staging buffers, run-wise import). The default runs all three.

    .venv/bin/python -m bench.kv.transport --out bench/kv/results/transport_cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.kv.common import services, write_result
from services.common.auth import auth_headers
from services.common.config import RunConfig
from services.engine.kv_cache import KVCache
from services.engine.kv_transfer import StagingBuffers, import_pages, page_nbytes
from services.kvstore.client import KVStoreClient, http_get_prefix
from services.kvstore.wire import MEDIA_TYPE, PutReply, encode_uniform_pages

LEGACY_PAGES_PER_CALL = 64


class LegacyClient:
    """The plain client data path (httpx over the gateway's HTTP routes, a bytes copy per page and a
    join, put copying its chunk into a new frame), kept here as the baseline: same frames, same
    gateway."""

    def __init__(self, url: str, max_call_bytes: int = 512 << 20):
        self.url, self.max_call_bytes = url, max_call_bytes
        self.http = httpx.Client(timeout=120, headers={"content-type": MEDIA_TYPE, **auth_headers()})

    def get_prefix(self, keys: list[bytes]) -> tuple[list[bytes], bytes]:
        # The shared HTTP reader, with the bytes copy per page (copy_pages).
        return http_get_prefix(self.http, self.url, keys, LEGACY_PAGES_PER_CALL, copy_pages=True)

    def put(self, keys: list[bytes], data: bytes, page_bytes: int) -> int:
        stored = 0
        view = memoryview(data)
        per_call = max(1, min(LEGACY_PAGES_PER_CALL, (self.max_call_bytes - 8) // (page_bytes + 20)))
        for start in range(0, len(keys), per_call):
            ks = keys[start : start + per_call]
            chunk = view[start * page_bytes : (start + len(ks)) * page_bytes]
            r = self.http.put(
                f"{self.url}/v1/pages", content=encode_uniform_pages(ks, bytes(chunk), page_bytes)
            )
            r.raise_for_status()
            stored += PutReply.model_validate_json(r.content).stored
        return stored

    def close(self) -> None:
        self.http.close()


def legacy_import(kv: KVCache, hashes: list[bytes], data: bytes) -> int:
    """A plain kv_transfer.import_pages (same bookkeeping): a join copy of the
    pages to import, frombuffer -> device, a contiguous copy per pool and one indexed write."""
    per = page_nbytes(kv)
    pages = [kv.blocks.allocate() for _ in hashes]
    view = memoryview(data)
    blob_bytes = b"".join(view[i * per : (i + 1) * per] for i in range(len(hashes)))
    n, bs = len(pages), kv.block_size
    idx = torch.tensor(pages, dtype=torch.long, device=kv.k.device)
    rows = (idx[:, None] * bs + torch.arange(bs, device=kv.k.device)).reshape(-1)
    blob = torch.frombuffer(bytearray(blob_bytes), dtype=torch.uint8).reshape(n, per).to(kv.k.device)
    off = 0
    for t in (kv.k, kv.v):
        inner = tuple(t.shape[2:])
        size = t.shape[0] * bs * t[0, 0].numel() * t.element_size()
        g = blob[:, off : off + size].contiguous().view(t.dtype)
        g = g.reshape(n, t.shape[0], bs, *inner).transpose(0, 1)
        t[:, rows] = g.reshape(t.shape[0], n * bs, *inner)
        off += size
    for page, h in zip(pages, hashes, strict=True):
        kv.blocks.register(page, h)
        kv.blocks.release(page)
    return n


def make_cache(args: argparse.Namespace, pages: int) -> KVCache:
    """A paged cache whose page is exactly one benchmark page: K and V of n_layers x kv heads x 128
    in bf16 (28 x 8 x 128 for the default 112 KiB per token)."""
    head_dim, n_kv = 128, 8
    per_token_layer = 2 * n_kv * head_dim * 2
    if args.token_bytes % per_token_layer:
        raise SystemExit(f"--token-bytes must be a multiple of {per_token_layer}")
    n_layers = args.token_bytes // per_token_layer
    return KVCache(
        n_layers, pages + 1, args.page_tokens, (pages + 1) * args.page_tokens, n_kv, head_dim,
        torch.bfloat16, torch.device(args.device),
    )  # fmt: skip


def run_path(path: str, args: argparse.Namespace, url: str, epoch: int) -> dict[str, Any]:
    page_bytes = args.page_tokens * args.token_bytes
    n = args.pages
    if path == "legacy":
        client: Any = LegacyClient(url)
    else:
        client = KVStoreClient(url, timeout_s=120, max_call_bytes=512 << 20, dataplane=path == "client")
    # What decode's pull does (router.pull_prefix): receive into a reused staging buffer (pinned on
    # CUDA), import straight from it. The legacy path gets a new bytes object per pull.
    buffers = StagingBuffers(pin=args.device.startswith("cuda"))
    cache = make_cache(args, n) if args.import_pages else None
    if cache is not None and page_nbytes(cache) != page_bytes:
        raise SystemExit(f"cache page {page_nbytes(cache)} != {page_bytes}")
    gen = torch.Generator().manual_seed(epoch)
    puts, gets, imports = [], [], []
    mb = n * page_bytes / 1e6
    for r in range(args.repeats):
        # Fresh keys per repeat (a put of keys the store has is a no-op there).
        keys = [os.urandom(16) for _ in range(n)]
        data = torch.randint(0, 256, (n * page_bytes,), dtype=torch.uint8, generator=gen).numpy().tobytes()
        t0 = time.perf_counter()
        stored = client.put(keys, data, page_bytes)
        puts.append(time.perf_counter() - t0)
        assert stored == n, f"{path}: stored {stored} of {n}"
        taken: list[tuple[torch.Tensor, int]] = []

        def alloc(size: int, taken: list[tuple[torch.Tensor, int]] = taken) -> memoryview:
            buf = buffers.take(size)
            taken.append((buf, size))
            return memoryview(buf.numpy())

        t0 = time.perf_counter()
        got, blob = client.get_prefix(keys) if path == "legacy" else client.get_prefix(keys, alloc)
        gets.append(time.perf_counter() - t0)
        assert got == keys and len(blob) == len(data), f"{path}: got {len(got)} of {n} pages"
        if r == 0:
            assert bytes(blob) == data, f"{path}: pulled bytes differ"
        src: Any = blob
        if taken:  # the pages are the tail of the reply body, received into buf[:size]
            buf, size = taken[-1]
            src = buf[size - len(blob) : size]
        if cache is not None:
            cache = make_cache(args, n)  # an empty pool each time: import_pages skips cached keys
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            done = legacy_import(cache, keys, blob) if path == "legacy" else import_pages(cache, keys, src)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            imports.append(time.perf_counter() - t0)
            assert done == n
        for buf, _size in taken:
            buffers.give(buf)
        print(
            f"{path:7s} repeat {r}: put {mb / puts[-1]:8.0f} MB/s  get {mb / gets[-1]:8.0f} MB/s"
            + (f"  import {mb / imports[-1]:8.0f} MB/s" if imports else ""),
            flush=True,
        )
    client.close()

    def rate(ts: list[float]) -> dict[str, float]:
        best, med = min(ts), statistics.median(ts)
        return {"mb_s_median": mb / med, "mb_s_best": mb / best, "s_median": med}

    out: dict[str, Any] = {"put": rate(puts), "get": rate(gets)}
    if imports:
        out["import"] = rate(imports)
        out["get_plus_import"] = rate([g + i for g, i in zip(gets, imports, strict=True)])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=64, help="pages per batch (one put, one get)")
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--token-bytes", type=int, default=28 * 2 * 8 * 128 * 2, help="KV bytes per token")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--paths",
        default="legacy,http,client",
        help="legacy: the plain client over HTTP; http: relay's client forced onto the HTTP "
        "routes; client: relay's client (the data plane)",
    )
    p.add_argument("--import-pages", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--device", default="cpu", help="where the import's KVCache lives")
    p.add_argument("--ram-bytes", type=int, default=4 << 30)
    p.add_argument("--workdir", default="")
    p.add_argument("--out", default="bench/kv/results/transport_cpu.json")
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-kv-transport-"))
    cfg = RunConfig()
    cfg.kvstore.ram_bytes, cfg.kvstore.disk_bytes = args.ram_bytes, 0
    results: dict[str, Any] = {}
    with services(work / "services", cfg) as svc:
        url = svc.url("kvstore", "kvstore")
        for i, path in enumerate(args.paths.split(",")):
            results[path] = run_path(path, args, url, i)
    page_bytes = args.page_tokens * args.token_bytes
    summary = {f"{p}_{op}_mb_s": r[op]["mb_s_median"] for p, r in results.items() for op in r}
    print(summary)
    write_result(
        Path(args.out),
        {
            "benchmark": "transport",
            "params": vars(args),
            "batch_bytes": args.pages * page_bytes,
            "page_bytes": page_bytes,
            "summary": summary,
            "path_meaning": {
                "legacy": "plain code path: client over the HTTP routes with its copies, plain import",
                "http": "relay's client forced onto the gateway's HTTP routes",
                "client": "relay's client: TCP data plane, reused staging buffers, run-wise import",
            },
            "paths": results,
        },
    )


if __name__ == "__main__":
    main()
