#!/usr/bin/python3
"""PyTorch eager's side of benchmarks/launch-overhead.sh: dtrain_bench_launches's training step
as a PyTorch 2.x user writes it, on CPU tensors.

The step: opt.zero_grad(set_to_none=True); logits = model(x); F.cross_entropy; backward;
torch.nn.utils.clip_grad_norm_(params, 1.0) (2.14 takes its foreach path on CPU tensors as
on CUDA ones: _foreach_norm, one coefficient, _foreach_mul_); AdamW(fused=True) (lr 6e-4,
betas 0.9/0.95, weight decay 0.1). The model is benchmarks/peer_pytorch_gpt2.py's GPT (the
like-for-like model of the peer comparison) with F.scaled_dot_product_attention, fp32.

  --attention math: SDPA's math backend (matmuls and softmax), as on a device without a fused
    attention kernel (dtrain's count on the fake accelerator); auto: flash attention.
  --mode count: outermost ATen calls per steady-state step, from torch.autograd.profiler's
    events: an "aten::" event with no "aten::" event around it on its thread, as
    tests/support/op_counter.h counts dtrain's.
  --mode time: the step's median time over --steps steps after --warmup, each ending with
    loss.item() (as dtrain_bench_launches --device cpu).
One JSON line on stdout. Needs python3-torch 2.4 or newer (fused AdamW on CPU).
"""
import argparse, json, os, statistics, sys, time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_pytorch_gpt2 import GPT  # noqa: E402


def outermost_aten(events):
    """Counts per name of the aten:: events with no aten:: ancestor."""
    counts = {}
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        parent, nested = e.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("aten::"):
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            counts[e.name] = counts.get(e.name, 0) + 1
    return counts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["count", "time"], required=True)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--attention", choices=["auto", "math"], default="auto",
                   help="auto: SDPA picks its kernel (flash on CPU and CUDA); math: SDPA's "
                        "composite math backend, what dtrain's fake accelerator runs")
    a = p.parse_args()
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps >= 1, --warmup >= 0")
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    model = GPT(a.vocab, a.ctx, a.layers, a.heads, a.dim, sdpa=True)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    x = torch.randint(0, a.vocab, (a.batch, a.ctx))
    y = torch.randint(0, a.vocab, (a.batch, a.ctx))

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss

    if a.attention == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        math_only = sdpa_kernel(SDPBackend.MATH)  # kept: collected, it would restore them
        math_only.__enter__()  # for the rest of the run
    for _ in range(a.warmup):
        step()
    shape = {"layers": a.layers, "heads": a.heads, "dim": a.dim, "ctx": a.ctx, "vocab": a.vocab,
             "batch": a.batch, "loss": "standard", "threads": a.threads,
             "attention": a.attention, "torch": torch.__version__}
    if a.mode == "count":
        with torch.autograd.profiler.profile() as prof:
            for _ in range(a.steps):
                step()
        counts = outermost_aten(prof.function_events)
        total = sum(counts.values())
        by_name = {k: v / a.steps for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))}
        print(json.dumps({"side": "pytorch", "device": "cpu", **shape,
                          "ops_per_step": total / a.steps, "by_name": by_name}))
    else:
        times, loss = [], None
        for _ in range(a.steps):
            t0 = time.perf_counter()
            loss = step().item()
            times.append(time.perf_counter() - t0)
        print(json.dumps({"side": "pytorch", "device": "cpu", **shape, "steps": a.steps,
                          "median_step_s": statistics.median(times), "min_step_s": min(times),
                          "final_loss": loss}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
