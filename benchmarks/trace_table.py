#!/usr/bin/env python3
"""Side by side: two Kineto traces of the same training steps (dtrain and PyTorch eager).

  trace_table.py --dtrain D.json --torch T.json --steps N [--top 20] [--json_out F] [--md_out F]

The traces are Chrome trace JSON as gpt2_train --trace_out and torch.profiler's
export_chrome_trace() write them, each covering N training steps. Printed (Markdown), per
side and per step:
  - kernels: GPU kernels launched;
  - GPU busy: the union of the kernels', copies' and memsets' intervals;
  - GPU idle: from the first GPU event to the last, the time no kernel, copy or memset ran
    (the GPU waiting for the host: launch overhead, host syncs, host-side work);
  - host syncs: CUDA runtime calls that block the host until the device is done
    (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, synchronous cudaMemcpy);
  - _local_scalar_dense: ATen's device-to-host scalar reads (.item() and kin), each one sync;
  - ATen operators: every recorded ATen event (nested ones included), the host's work;
then the top kernels by time (the larger of the two sides), with calls and time per step.
Only the standard library: runs anywhere.
"""
import argparse, json, sys
from collections import defaultdict

# Category names as recent Kineto writes them (lower case) and as older versions did.
KERNEL = {"kernel"}
GPU_OTHER = {"gpu_memcpy", "gpu_memset", "memcpy", "memset"}
RUNTIME = {"cuda_runtime", "cuda_driver", "runtime"}
CPU_OP = {"cpu_op", "operator"}
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize"}


def load_events(path):
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return events


def busy_time(intervals):
    """Total length of the union of [start, end) intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize(events, steps):
    events = [e for e in events if e.get("ph") == "X"]  # complete events: those with a duration
    cat = lambda e: str(e.get("cat", "")).lower()
    kernels = [e for e in events if cat(e) in KERNEL]
    gpu = kernels + [e for e in events if cat(e) in GPU_OTHER]
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in gpu]
    busy = busy_time(intervals)
    span = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0.0
    syncs = sum(1 for e in events if cat(e) in RUNTIME and e.get("name") in SYNC_CALLS)
    ops = [e for e in events if cat(e) in CPU_OP]
    scalar_reads = sum(1 for e in ops if e.get("name") == "aten::_local_scalar_dense")
    by_kernel = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        k = by_kernel[e.get("name", "?")]
        k[0] += 1
        k[1] += float(e.get("dur", 0))
    per = lambda v: v / steps
    return {
        "steps": steps,
        "kernels_per_step": per(len(kernels)),
        "gpu_busy_ms_per_step": per(busy) / 1e3,
        "gpu_idle_ms_per_step": per(span - busy) / 1e3,
        "host_syncs_per_step": per(syncs),
        "local_scalar_dense_per_step": per(scalar_reads),
        "aten_ops_per_step": per(len(ops)),
        "kernels": {name: {"calls_per_step": per(c), "ms_per_step": per(us) / 1e3}
                    for name, (c, us) in by_kernel.items()},
    }


def table(d, t, top):
    rows = [("kernels", "kernels_per_step", "{:.0f}"),
            ("GPU busy (ms)", "gpu_busy_ms_per_step", "{:.3f}"),
            ("GPU idle between kernels (ms)", "gpu_idle_ms_per_step", "{:.3f}"),
            ("host syncs", "host_syncs_per_step", "{:.1f}"),
            ("_local_scalar_dense", "local_scalar_dense_per_step", "{:.1f}"),
            ("ATen operators (host)", "aten_ops_per_step", "{:.0f}")]
    out = [f"Per step ({d['steps']} traced steps on each side).", "",
           "| per step | dtrain | PyTorch eager | dtrain / PyTorch |", "|---|---|---|---|"]
    for label, key, fmt in rows:
        ratio = f"{d[key] / t[key]:.2f}" if t[key] else "n/a"
        out.append(f"| {label} | {fmt.format(d[key])} | {fmt.format(t[key])} | {ratio} |")
    names = set(d["kernels"]) | set(t["kernels"])
    size = lambda n: max(d["kernels"].get(n, {}).get("ms_per_step", 0),
                         t["kernels"].get(n, {}).get("ms_per_step", 0))
    ranked = sorted(names, key=lambda n: (-size(n), n))[:top]
    out += ["", f"Top {len(ranked)} CUDA kernels by time (the larger side), per step:", "",
            "| kernel | dtrain ms | dtrain calls | PyTorch ms | PyTorch calls |",
            "|---|---|---|---|---|"]
    cell = lambda side, n: (f"{side['kernels'][n]['ms_per_step']:.3f} | "
                            f"{side['kernels'][n]['calls_per_step']:.1f}"
                            if n in side["kernels"] else "- | 0")
    for n in ranked:
        short = n if len(n) <= 90 else n[:87] + "..."
        out.append(f"| `{short.replace('|', '/')}` | {cell(d, n)} | {cell(t, n)} |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtrain", required=True)
    p.add_argument("--torch", required=True)
    p.add_argument("--steps", type=int, required=True, help="training steps in each trace")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--json_out", default="", help="also write the figures here as JSON")
    p.add_argument("--md_out", default="", help="also write the table here")
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error("--steps must be at least 1")
    d = summarize(load_events(a.dtrain), a.steps)
    t = summarize(load_events(a.torch), a.steps)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"dtrain": d, "pytorch": t}, f, indent=1)
    text = table(d, t, a.top)
    if a.md_out:
        with open(a.md_out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
