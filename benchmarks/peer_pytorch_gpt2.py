#!/usr/bin/python3
"""PyTorch (Python) reference run for the peer comparison in benchmarks/peer-comparison.sh.

Trains the same GPT-2 shape as `gpt2_train --model tiny` (4 layers, 4 heads, dim 256,
ctx 128, vocab 50257, tied head, pre-LayerNorm, GELU tanh, GPT-2 init) on synthetic
tokens with AdamW (betas 0.9/0.95, weight decay 0.1) and gradient clipping at 1.0, either
in one process (--nproc 1) or over Gloo (--nproc N, one process per rank started with the
'spawn' method) with DistributedDataParallel (--strategy ddp) or, PyTorch 2.x, FSDP:
--strategy fsdp is FSDP1 (FullyShardedDataParallel, FULL_SHARD, one unit per block plus the
root, device_id cpu); --strategy fsdp2 is what a PyTorch 2.14 user writes, fully_shard on each
block, then on the root (PyTorch 2.6's fully_shard fails on CPU with "'Stream' object has no
attribute 'record_event'"; 2.14's trains over gloo). --check_single (with --nproc > 1): before
training, a separate process (so that its memory is in no rank's peak RSS) runs step 0 on
every rank's rows together, and the run fails unless the distributed step-0 loss and
gradient norm equal it (relative 1e-4): a peer
that sums gradients instead of averaging them (reported upstream for FSDP2 over gloo) doubles
the norm and is never benchmarked. --attention explicit: matmul, mask,
softmax, matmul (what PyTorch 1.13 offers); sdpa: F.scaled_dot_product_attention (2.x). Threads per rank = cores / ranks, as
dtrain's trainer does. Writes one JSON line per step (rank 0): tokens_per_s, step_time_s,
peak_rss_mib (max over ranks).
With --profile_out (rank 0), torch.autograd.profiler.profile() records --profile_steps steps
after the first 5 (the same RecordFunction events as gpt2_train --profile_out, see
examples/gpt2/op_profile.h) and writes per operator name calls, self and total CPU time as
JSON: {"steps", "wall_s", "ops": [{"name", "calls", "self_s", "total_s"}, ...]}.
Needs Debian's python3-torch (run with /usr/bin/python3): bookworm's 1.13 or, inside
scripts/chroot.sh's trixie root, 2.6.
"""
import argparse, contextlib, json, math, os, resource, time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim, heads, sdpa):
        super().__init__()
        self.heads = heads
        self.sdpa = sdpa
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.mlp_proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)
            mask = torch.ones(T, T, dtype=torch.bool).triu(1)
            att = att.masked_fill(mask, float("-inf")).softmax(-1)
            y = att @ v
        y = y.transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, ctx, layers, heads, dim, sdpa=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(ctx, dim)
        self.h = nn.ModuleList(Block(dim, heads, sdpa) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("c_proj.weight", "mlp_proj.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for b in self.h:
            x = b(x)
        return F.linear(self.ln_f(x), self.wte.weight)


PROFILE_WARMUP_STEPS = 5  # as gpt2_train: steps before profiling starts
# RecordScope values (ATen's record_function.h) kept in the profile, as gpt2_train keeps them:
# FUNCTION (operators, the autograd engine's evaluate_function) and BACKWARD_FUNCTION
# (autograd nodes). USER_SCOPE ranges such as "Optimizer.step#AdamW.step" or DDP's
# "DistributedDataParallel.forward" and "gloo:all_reduce" are dropped: their self time is
# the interpreter's or another thread's, which the table counts as outside recorded ops.
PROFILE_SCOPES = (0, 1)


class OpProfile:
    """Per-operator totals over the profiled steps, from each step's key_averages()."""

    def __init__(self):
        self.steps, self.wall_s, self.ops = 0, 0.0, {}

    def add_step(self, prof, wall_s):
        self.steps += 1
        self.wall_s += wall_s
        for e in prof.key_averages():
            if e.scope not in PROFILE_SCOPES:
                continue
            o = self.ops.setdefault(e.key, {"name": e.key, "calls": 0, "self_s": 0.0, "total_s": 0.0})
            o["calls"] += e.count
            o["self_s"] += e.self_cpu_time_total * 1e-6  # microseconds
            o["total_s"] += e.cpu_time_total * 1e-6

    def write(self, path):
        ops = sorted(self.ops.values(), key=lambda o: (-o["self_s"], o["name"]))
        with open(path, "w") as f:
            json.dump({"steps": self.steps, "wall_s": self.wall_s, "ops": ops}, f, indent=1)
            f.write("\n")


def batch(gen, args):
    x = torch.randint(0, 50257, (args.batch, 128), generator=gen)
    y = torch.randint(0, 50257, (args.batch, 128), generator=gen)
    return x, y


def new_model(args):
    torch.manual_seed(1)
    return GPT(50257, 128, 4, 4, 256, sdpa=args.attention == "sdpa")


def step0_single(args, world, results):
    """Step 0's loss and gradient norm in one process on every rank's rows (the ranks'
    initial model), put on `results`; runs in its own process."""
    torch.set_num_threads(os.cpu_count())
    m = new_model(args)
    rows = [batch(torch.Generator().manual_seed(1234 + r), args) for r in range(world)]
    x = torch.cat([r[0] for r in rows])
    y = torch.cat([r[1] for r in rows])
    logits = m(x)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf"))
    results.put((loss.item(), norm.item()))


def check_step0(loss, norm, reference, rank, world):
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean = mean.item() / world
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    norm = float(norm)
    if rank != 0:
        return
    want_loss, want_norm = reference
    ok = abs(mean - want_loss) <= 1e-4 * abs(want_loss) and abs(norm - want_norm) <= 1e-4 * want_norm
    print(f"check_single: step 0 loss {mean:.6f} vs one process {want_loss:.6f}, "
          f"grad norm {norm:.6f} vs {want_norm:.6f}: {'equal' if ok else 'DIFFERENT'}", flush=True)
    if not ok:
        raise SystemExit("check_single: the distributed run does not train what one process "
                         "trains on the global batch; not benchmarking it")


def run(rank, args, reference=None):
    world = args.nproc
    torch.set_num_threads(max(1, os.cpu_count() // world))
    if world > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(args.port))
        # Debian's PyTorch 2.x is built without libuv, which its TCPStore uses by default.
        os.environ.setdefault("USE_LIBUV", "0")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    model = new_model(args)
    fsdp = world > 1 and args.strategy == "fsdp"
    if world > 1 and args.strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.h:
            fully_shard(block)
        fully_shard(model)
    elif fsdp:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        model = FullyShardedDataParallel(model, sharding_strategy=ShardingStrategy.FULL_SHARD,
                                         auto_wrap_policy=ModuleWrapPolicy({Block}),
                                         device_id=torch.device("cpu"))
    elif world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(1234 + rank)
    out = open(args.metrics_out, "w") if rank == 0 else None
    profile = OpProfile() if rank == 0 and args.profile_out else None
    for step in range(args.steps):
        x, y = batch(gen, args)
        in_window = args.profile_out and \
            PROFILE_WARMUP_STEPS <= step < PROFILE_WARMUP_STEPS + args.profile_steps
        # The profiler is entered before t0 and left after dt: the same step as step_time_s.
        profiled = profile is not None and in_window
        prof = torch.autograd.profiler.profile() if profiled else None
        with prof if prof is not None else contextlib.nullcontext():
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            loss.backward()
            if fsdp:
                norm = model.clip_grad_norm_(1.0)  # the norm over every rank's shards
            else:  # FSDP2's DTensor gradients: the global norm, as a replicated DTensor
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss_value = loss.item()
            dt = time.perf_counter() - t0
        if step == 0 and world > 1 and args.check_single:
            check_step0(loss, norm, reference, rank, world)
        rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
        if world > 1:
            dist.all_reduce(rss, op=dist.ReduceOp.MAX)
        if out:
            out.write(json.dumps({"kind": "step", "step": step, "loss": loss_value, "step_time_s": dt,
                                  "tokens_per_s": args.batch * 128 * world / dt,
                                  "peak_rss_mib": rss.item()}) + "\n")
            out.flush()
        if prof is not None:
            profile.add_step(prof, dt)
            if profile.steps == args.profile_steps:
                profile.write(args.profile_out)
        if in_window and world > 1:
            # Leaving the profiler and averaging take rank 0 a while; without this the other
            # ranks would run ahead and change what rank 0's next profiled step sees.
            dist.barrier()
    if profile and profile.steps < args.profile_steps:
        print(f"profile: only {profile.steps} of --profile_steps {args.profile_steps} steps "
              f"profiled (first {PROFILE_WARMUP_STEPS} are warm-up)")
        profile.write(args.profile_out)
    if world > 1:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--strategy", choices=["ddp", "fsdp", "fsdp2"], default="ddp",
                   help="with --nproc > 1: DistributedDataParallel, FullyShardedDataParallel "
                        "(FSDP1) or fully_shard (FSDP2)")
    p.add_argument("--check_single", action="store_true",
                   help="with --nproc > 1: fail unless step 0 equals one process on the global batch")
    p.add_argument("--attention", choices=["explicit", "sdpa"], default="explicit",
                   help="explicit matmul-softmax-matmul, or F.scaled_dot_product_attention")
    p.add_argument("--metrics_out", required=True)
    p.add_argument("--profile_out", default="",
                   help="rank 0: per-operator profile (JSON) of --profile_steps steps after "
                        "the first 5; empty: off")
    p.add_argument("--profile_steps", type=int, default=5)
    args = p.parse_args()
    if args.profile_out and args.profile_steps < 1:
        p.error("--profile_steps must be at least 1 with --profile_out")
    if args.nproc == 1:
        run(0, args)
        return
    reference = None
    if args.check_single:
        ctx = mp.get_context("spawn")
        results = ctx.SimpleQueue()
        single = ctx.Process(target=step0_single, args=(args, args.nproc, results))
        single.start()
        single.join()
        if single.exitcode != 0:
            raise SystemExit(f"check_single: the one-process reference failed ({single.exitcode})")
        reference = results.get()
    mp.spawn(run, args=(args, reference), nprocs=args.nproc)


if __name__ == "__main__":
    main()
