#!/usr/bin/env python3
"""Summarise benchmarks/bench-slow-network.sh's runs: one table per link rate.

Usage: slow_network_summary.py RESULTS_DIR [STEPS]
RESULTS_DIR holds one folder per rate (100mbit, 1gbit, none), each with SETTING.jsonl
(gpt2_train --metrics_out). Writes RESULTS_DIR/summary.csv, summary.json and tables.md.
STEPS: the steps of the reference run (default: those in ddp.jsonl); the other runs may be
longer (the same constant learning rate after warmup, so their first STEPS steps are what a
STEPS-step run does).

Per run, against the rate's uncompressed DDP run ("ddp", the reference):
  target        ddp's validation loss at the last validation step at or before 80% of its
                steps (the same target for every run of the rate)
  time_to_target_s  training time (sum of step_time_s: validation excluded) up to the first
                validation step whose val_loss <= target; null when never reached
  steps_to_target   that validation's step
  speedup       ddp's time_to_target_s / this run's
  final_val_loss    validation loss at step STEPS; final_loss_diff_pct relative to ddp's
  inter_host_bytes_per_step  median over the second half of the steps of the counted
                wire_bytes_inter_host (steady state: PowerSGD's first steps are plain
                all-reduces); inter_host_bytes_per_step_mean over all steps
  bytes_reduction   ddp's inter_host_bytes_per_step / this run's
  step_time_s   median step_time_s over the second half of the steps
"""
import csv
import json
import pathlib
import statistics
import sys

RATES = ["100mbit", "1gbit", "none"]
SETTINGS = ["ddp", "ddp_powersgd1", "ddp_powersgd2", "ddp_powersgd4", "ddp_int8", "ddp_bf16",
            "fsdp", "fsdp_int8", "fsdp_host", "fsdp_int8_host", "fsdp_int4_host"]
LABELS = {
    "ddp": "DDP, uncompressed (reference)",
    "ddp_powersgd1": "DDP + PowerSGD rank 1",
    "ddp_powersgd2": "DDP + PowerSGD rank 2",
    "ddp_powersgd4": "DDP + PowerSGD rank 4",
    "ddp_int8": "DDP + --quantize_grads int8",
    "ddp_bf16": "DDP + --quantize_grads bf16",
    "fsdp": "FSDP, uncompressed",
    "fsdp_int8": "FSDP + --quantize_params int8 --quantize_grads int8",
    "fsdp_host": "FSDP + --reshard_after_forward host",
    "fsdp_int8_host": "FSDP + int8 params and grads + --reshard_after_forward host",
    "fsdp_int4_host": "FSDP + int8 params, int4 grads + --reshard_after_forward host",
}
FIELDS = ["rate", "setting", "steps", "target_val_loss", "time_to_target_s",
          "steps_to_target", "speedup",
          "final_val_loss", "final_loss_diff_pct", "final_train_loss",
          "inter_host_bytes_per_step", "inter_host_bytes_per_step_mean", "bytes_reduction",
          "intra_host_bytes_per_step", "step_time_s", "comm_wait_s", "train_time_s",
          "peak_rss_mib", "blas_kernel"]


def load(path):
    steps, final = [], None
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "step":
            steps.append(rec)
        elif rec["kind"] == "epoch":
            final = rec
    if not steps or final is None:
        return None  # unfinished run
    return steps, final


def validations(steps, final):
    """(step, val_loss, training seconds up to that step) of every validation."""
    out, t = [], 0.0
    for r in steps:
        t += r["step_time_s"]
        if r.get("val_loss") is not None:
            out.append((r["step"], r["val_loss"], t))
    out.append((final["step"], final["val_loss"], t))
    return out


def run_summary(steps, final, same_steps):
    n = len(steps)
    half = steps[n // 2:]
    inter = [r.get("wire_bytes_inter_host") for r in steps]
    counted = all(x is not None for x in inter)
    at = [v for v in validations(steps, final) if v[0] == same_steps]
    return {
        "steps": n,
        "final_val_loss": at[0][1] if at else None,
        "final_train_loss": steps[min(same_steps, n) - 1]["loss"],
        "inter_host_bytes_per_step":
            statistics.median(r["wire_bytes_inter_host"] for r in half) if counted else None,
        "inter_host_bytes_per_step_mean": statistics.fmean(inter) if counted else None,
        "intra_host_bytes_per_step":
            statistics.median(r["wire_bytes_intra_host"] for r in half) if counted else None,
        "step_time_s": statistics.median(r["step_time_s"] for r in half),
        "comm_wait_s": statistics.median(r.get("comm_wait_s") or 0 for r in half),
        "train_time_s": sum(r["step_time_s"] for r in steps),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in steps),
        "blas_kernel": steps[-1].get("blas_kernel"),
    }


def summarise_rate(folder, same_steps):
    runs = {}
    for s in SETTINGS:
        p = folder / f"{s}.jsonl"
        if p.exists():
            loaded = load(p)
            if loaded:
                runs[s] = loaded
    if not runs:
        return []
    target = ref_time = ref = None
    if "ddp" in runs:
        steps, final = runs["ddp"]
        same_steps = same_steps or len(steps)
        vals = validations(steps, final)
        at = 0.8 * same_steps
        before = [v for v in vals if v[0] <= at]
        target = (before[-1] if before else vals[0])[1]
        ref = run_summary(steps, final, same_steps)
    rows = []
    for s, (steps, final) in runs.items():
        row = {"rate": folder.name, "setting": s,
               **run_summary(steps, final, same_steps or len(steps))}
        row["target_val_loss"] = target
        row["time_to_target_s"] = row["steps_to_target"] = None
        if target is not None:
            reached = [v for v in validations(steps, final) if v[1] <= target]
            if reached:
                row["steps_to_target"], row["time_to_target_s"] = reached[0][0], reached[0][2]
        rows.append(row)
    ref_row = next((r for r in rows if r["setting"] == "ddp"), None)
    for row in rows:
        row["speedup"] = row["final_loss_diff_pct"] = row["bytes_reduction"] = None
        if ref_row is None:
            continue
        if row["time_to_target_s"] and ref_row["time_to_target_s"]:
            row["speedup"] = ref_row["time_to_target_s"] / row["time_to_target_s"]
        if row["final_val_loss"] is not None and ref["final_val_loss"]:
            row["final_loss_diff_pct"] = (
                100 * (row["final_val_loss"] - ref["final_val_loss"]) / ref["final_val_loss"])
        if row["inter_host_bytes_per_step"] and ref["inter_host_bytes_per_step"]:
            row["bytes_reduction"] = (
                ref["inter_host_bytes_per_step"] / row["inter_host_bytes_per_step"])
    return rows


def fmt(x, spec):
    return "—" if x is None else format(x, spec)


def table(rate, rows):
    title = {"none": "unthrottled"}.get(rate, rate.replace("mbit", " Mbit/s").replace(
        "gbit", " Gbit/s"))
    target = rows[0]["target_val_loss"]
    lines = [f"### {title}", "",
             f"Target validation loss {fmt(target, '.4f')} (uncompressed DDP's at 80% of "
             "the steps).", "",
             "| setting | time to target (s) | steps | speedup | val loss at the same "
             "steps | vs uncompressed | inter-host MB/step | bytes reduction | step time (s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        mb = None if r["inter_host_bytes_per_step"] is None else (
            r["inter_host_bytes_per_step"] / 1e6)
        lines.append(
            f"| {LABELS[r['setting']]} | {fmt(r['time_to_target_s'], '.1f')}"
            f"{'' if r['time_to_target_s'] is not None else ' (not reached)'} "
            f"| {fmt(r['steps_to_target'], 'd')} | {fmt(r['speedup'], '.2f')}"
            f"{'x' if r['speedup'] is not None else ''} "
            f"| {fmt(r['final_val_loss'], '.4f')} "
            f"| {fmt(r['final_loss_diff_pct'], '+.2f')}% | {fmt(mb, '.2f')} "
            f"| {fmt(r['bytes_reduction'], '.1f')}{'x' if r['bytes_reduction'] else ''} "
            f"| {fmt(r['step_time_s'], '.3f')} |")
    return "\n".join(lines) + "\n"


def main():
    results = pathlib.Path(sys.argv[1])
    same_steps = int(sys.argv[2]) if len(sys.argv) > 2 else None
    all_rows, tables = [], []
    for rate in RATES + sorted(p.name for p in results.iterdir()
                               if p.is_dir() and p.name not in RATES):
        folder = results / rate
        if not folder.is_dir():
            continue
        rows = summarise_rate(folder, same_steps)
        if rows:
            all_rows += rows
            tables.append(table(rate, rows))
    with open(results / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in all_rows:
            w.writerow({k: r.get(k) for k in FIELDS})
    (results / "summary.json").write_text(json.dumps(all_rows, indent=1) + "\n")
    (results / "tables.md").write_text("\n".join(tables))
    print("\n".join(tables))


if __name__ == "__main__":
    main()
