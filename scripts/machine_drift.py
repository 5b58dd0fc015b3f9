"""How much this machine's speed moves on its own: the noise floor of any one measurement here.

Usage: .venv/bin/python scripts/machine_drift.py [SECONDS] [--out FILE.jsonl] [--tokens N]

Run it on an otherwise idle machine. It repeats the same work for SECONDS (default 300): three
forward + backward + Adam steps of one 768-wide transformer layer (batch 2, 512 tokens), one
thread, and just before each repeat two probes: the FLOP/s of a 512x512 fp32 matmul for 0.3 s
and the bandwidth of copying a 64 MiB tensor (median of 5). Each repeat is a JSON line; the
summary says how much the fixed work varied (coefficient of variation, range over ~25 s
windows) and how well each probe tracked it (correlation, log-log slope). Nothing here is used
by the harness; README "Measuring through the noise" quotes one run of it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from bench.metrics import measure_cpu_matmul_flops      # the same probe a run takes at launch


def copy_gbps(src: torch.Tensor, dst: torch.Tensor, repeats: int = 5) -> float:
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        rates.append(2 * src.numel() * src.element_size() / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def summary(rows: list[dict], window: int = 10) -> str:
    work = np.array([r["work_s"] for r in rows])
    lines = [f"{len(rows)} repeats of the fixed work: median {np.median(work):.3f} s, range {work.min():.3f}.."
             f"{work.max():.3f} s, coefficient of variation {100 * work.std() / work.mean():.1f}%"]
    if len(rows) >= 2 * window:
        means = [work[i:i + window].mean() for i in range(0, len(work) - window + 1, window)]
        lines.append(f"means of {window} consecutive repeats: {min(means):.3f}..{max(means):.3f} s")
    for probe in ("matmul_gflops", "copy_gbps"):
        x = np.array([r[probe] for r in rows])
        if len(rows) > 2 and x.std() > 0:
            slope = np.polyfit(np.log(x), np.log(work), 1)[0]
            lines.append(f"{probe}: {x.min():.1f}..{x.max():.1f}, correlation with the work's time "
                         f"{np.corrcoef(x, work)[0, 1]:+.2f}, log-log slope {slope:+.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("seconds", nargs="?", type=float, default=300.0)
    ap.add_argument("--out", default=None, help="also write the repeats as JSON lines here")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per sequence of the fixed work (default 512)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    src = torch.randn(16 << 20)                  # 64 MiB of fp32, well past the caches
    dst = torch.empty_like(src)
    layer = torch.nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True)
    opt = torch.optim.Adam(layer.parameters())
    x = torch.randn(2, args.tokens, 768)

    def work() -> float:
        start = time.perf_counter()
        for _ in range(3):
            layer(x).sum().backward()
            opt.step()
            opt.zero_grad()
        return time.perf_counter() - start

    work()                                       # warm-up: allocations, optimizer state
    rows, end = [], time.time() + args.seconds
    while time.time() < end:
        rows.append({"time": time.time(), "matmul_gflops": measure_cpu_matmul_flops(seconds=0.3) / 1e9,
                     "copy_gbps": copy_gbps(src, dst), "work_s": work()})
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
