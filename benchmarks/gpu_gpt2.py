#!/usr/bin/env python3
"""GPU acceptance helpers for scripts/gpu-check.sh (docs/nccl.md, "GPU acceptance").

  gpu_gpt2.py torch --metrics_out F [--batch B --steps S --layers ...]
      PyTorch eager reference: the same GPT-2 shape as `gpt2_train --model gpt2` (12 layers,
      12 heads, dim 768, ctx 1024, vocab 50257, tied head, pre-LayerNorm, GELU tanh, GPT-2
      init), attention through F.scaled_dot_product_attention (causal), bf16 autocast, fused
      AdamW (betas 0.9/0.95, weight decay 0.1), clipping at 1.0, synthetic tokens, on cuda:0.
      One JSON line per step: tokens_per_s, step_time_s, loss, cuda_peak_mib
      (torch.cuda.max_memory_allocated, the figure gpt2_train's cuda_peak_mib mirrors).
      With --trace_out F: a Kineto trace (torch.profiler, CPU and CUDA activities) of the
      --trace_steps steps after the first --trace_start (5 and 3: gpt2_train --trace_out's
      window with --profile_steps 3), written with export_chrome_trace.
  gpu_gpt2.py report --dtrain F --torch F --params N --layers L --dim D --ctx T [--peak_tflops P]
      Tokens/s (median of the steps after --warmup), MFU and cuda_peak_mib of both, as JSON
      and a Markdown table.
  gpu_gpt2.py compare --reference F --candidate F [--rtol R]
      Whether a strategy run's per-step losses match single-device's within R (relative).

MFU = (6 * N + 12 * L * D * T) * tokens_per_s / peak, with N every parameter (the tied
embedding once), L layers, D the model width, T the context: the forward and backward
FLOPs per token of the matmuls (6N) and of attention's scores and weighted sum (12 L D T,
as in PaLM's appendix B), over the GPU's dense bf16 peak (H100 SXM and H200: 989 TFLOP/s).
Only `torch` needs PyTorch; `report` and `compare` run anywhere.
"""
import argparse, json, math, os, statistics, sys, time


def read_steps(path):
    steps = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            j = json.loads(line)
            if j.get("kind", "step") == "step":
                steps.append(j)
    return steps


def flops_per_token(params, layers, dim, ctx):
    return 6 * params + 12 * layers * dim * ctx


def summarize(steps, warmup, fpt, peak):
    timed = steps[warmup:] if len(steps) > warmup else steps
    tps = statistics.median(s["tokens_per_s"] for s in timed) if timed else float("nan")
    peaks = [s["cuda_peak_mib"] for s in steps if s.get("cuda_peak_mib") is not None]
    return {"steps": len(steps), "timed_steps": len(timed), "tokens_per_s": tps,
            "mfu": fpt * tps / peak if timed else float("nan"),
            "cuda_peak_mib": max(peaks) if peaks else None,
            "final_loss": steps[-1]["loss"] if steps else None}


def cmd_report(a):
    fpt = flops_per_token(a.params, a.layers, a.dim, a.ctx)
    peak = a.peak_tflops * 1e12
    d = summarize(read_steps(a.dtrain), a.warmup, fpt, peak)
    t = summarize(read_steps(a.torch), a.warmup, fpt, peak)
    ratio = d["tokens_per_s"] / t["tokens_per_s"] if t["tokens_per_s"] else float("nan")
    out = {"flops_per_token": fpt, "peak_tflops": a.peak_tflops, "dtrain": d, "pytorch": t,
           "tokens_per_s_ratio": ratio}
    print(json.dumps(out))
    mib = lambda v: "n/a" if v is None else f"{v:.0f}"
    print("\n| | tokens/s | MFU | cuda_peak_mib | final loss |\n|---|---|---|---|---|", file=sys.stderr)
    for name, s in (("dtrain (gpt2_train)", d), ("PyTorch eager (SDPA)", t)):
        print(f"| {name} | {s['tokens_per_s']:.0f} | {100 * s['mfu']:.1f}% | {mib(s['cuda_peak_mib'])} "
              f"| {s['final_loss']} |", file=sys.stderr)
    print(f"\ndtrain / PyTorch tokens/s: {ratio:.3f} (goal >= 1.1); MFU goal >= 40%", file=sys.stderr)


def cmd_compare(a):
    ref, cand = read_steps(a.reference), read_steps(a.candidate)
    if len(ref) != len(cand) or not ref:
        print(json.dumps({"match": False, "why": f"{len(cand)} steps vs {len(ref)} of the reference"}))
        return 1
    worst = 0.0
    for r, c in zip(ref, cand):
        if not (math.isfinite(r["loss"]) and math.isfinite(c["loss"])):
            print(json.dumps({"match": False, "why": f"step {r['step']}: non-finite loss"}))
            return 1
        worst = max(worst, abs(c["loss"] - r["loss"]) / max(abs(r["loss"]), 1e-12))
    ok = worst <= a.rtol
    print(json.dumps({"match": ok, "steps": len(ref), "max_rel_loss_diff": worst, "rtol": a.rtol}))
    return 0 if ok else 1


def cmd_torch(a):
    import torch
    import torch.nn.functional as F

    # The same model code as the CPU peer comparison (GPT-2 with fused attention).
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from peer_pytorch_gpt2 import GPT

    dev = torch.device("cuda", 0)
    torch.manual_seed(1)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = GPT(a.vocab, a.ctx, a.layers, a.heads, a.dim, sdpa=True).to(dev)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    gen = torch.Generator(device=dev).manual_seed(1234)
    prof = None
    with open(a.metrics_out, "w") as out:
        for step in range(a.steps):
            if a.trace_out and step == a.trace_start:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
                prof.__enter__()
            x = torch.randint(0, a.vocab, (a.batch, a.ctx), generator=gen, device=dev)
            y = torch.randint(0, a.vocab, (a.batch, a.ctx), generator=gen, device=dev)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss_value = loss.item()  # synchronizes
            dt = time.perf_counter() - t0
            out.write(json.dumps({"kind": "step", "step": step, "loss": loss_value,
                                  "step_time_s": dt, "tokens_per_s": a.batch * a.ctx / dt,
                                  "cuda_peak_mib": torch.cuda.max_memory_allocated(dev) / 2**20,
                                  "params": params}) + "\n")
            out.flush()
            if prof is not None and step + 1 == a.trace_start + a.trace_steps:
                prof.__exit__(None, None, None)
                prof.export_chrome_trace(a.trace_out)
                prof = None
    if prof is not None:
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(a.trace_out)
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                      "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                      "gpu": torch.cuda.get_device_name(dev), "params": params,
                      "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI)}))


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("torch")
    t.add_argument("--metrics_out", required=True)
    t.add_argument("--batch", type=int, default=16)
    t.add_argument("--steps", type=int, default=30)
    t.add_argument("--layers", type=int, default=12)
    t.add_argument("--heads", type=int, default=12)
    t.add_argument("--dim", type=int, default=768)
    t.add_argument("--ctx", type=int, default=1024)
    t.add_argument("--vocab", type=int, default=50257)
    t.add_argument("--trace_out", default="")
    t.add_argument("--trace_start", type=int, default=5)
    t.add_argument("--trace_steps", type=int, default=3)
    r = sub.add_parser("report")
    r.add_argument("--dtrain", required=True)
    r.add_argument("--torch", required=True)
    r.add_argument("--params", type=int, required=True)
    r.add_argument("--layers", type=int, default=12)
    r.add_argument("--dim", type=int, default=768)
    r.add_argument("--ctx", type=int, default=1024)
    r.add_argument("--warmup", type=int, default=10)
    r.add_argument("--peak_tflops", type=float, default=989.0)
    c = sub.add_parser("compare")
    c.add_argument("--reference", required=True)
    c.add_argument("--candidate", required=True)
    c.add_argument("--rtol", type=float, default=1e-3)
    a = p.parse_args()
    return {"torch": cmd_torch, "report": cmd_report, "compare": cmd_compare}[a.cmd](a) or 0


if __name__ == "__main__":
    sys.exit(main())
