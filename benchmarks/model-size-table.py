#!/usr/bin/env python3
"""The model-size table (issue 30) from the runs bench-model-size.sh left in OUT/runs.

  model-size-table.py OUT      writes OUT/model-size.md, OUT/model-size.csv, OUT/model-size.json

Per run (NAME.cmd, NAME.log, NAME.jsonl, NAME.rc): the planner's estimate per rank (accepted:
"memory: estimated peak X GiB", refused: "needs an estimated X GiB"), the peak RSS of every
rank at the last step record (VmHWM: the whole run, set-up included), and the set-up line
("model: built, initialised and wrapped in X s; peak RSS per rank ... MiB (... MiB before
the model)"). From the
training runs: the largest preset each strategy trains within 2, 4 and 8 GiB per rank (its
measured peak; a refused run counts with its estimate, marked so). For FSDP runs: the set-up
peak per rank, whole and less the RSS before the model (libraries, data), against 1/N of the
model's fp32 bytes plus its largest unit's (the tied token embedding with the position table
and the final LayerNorm, the root when the loss is not fused).
"""
import csv
import json
import pathlib
import re
import sys

PRESETS = ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]
DIM = {"gpt2": 768, "gpt2-medium": 1024, "gpt2-large": 1280, "gpt2-xl": 1600}
VOCAB, CTX = 50257, 128
STRATEGIES = {"single": ("single", 1), "ddp": ("DDP", 4), "fsdp": ("FSDP full shard", 4)}
LIMITS_GIB = [2, 4, 8]
MIB = 1 << 20


def read(path):
    return path.read_text() if path.exists() else ""


def parse_run(runs, name):
    log = read(runs / f"{name}.log")
    cmd = read(runs / f"{name}.cmd").strip()
    rc = read(runs / f"{name}.rc").strip()
    run = {"name": name, "command": cmd, "exit": int(rc) if rc else None}
    m = re.search(r"--memory_per_rank ([0-9.]+)", cmd)
    run["memory_per_rank_gib"] = float(m.group(1)) if m else None
    m = re.search(r"memory: estimated peak ([0-9.]+) GiB", log)
    refused = re.search(r"needs an estimated ([0-9.]+) GiB[^\n]*", log)
    run["estimate_gib"] = float(m.group(1)) if m else (float(refused.group(1)) if refused
                                                         else None)
    run["refusal"] = refused.group(0) if refused and run["exit"] != 0 else None
    m = re.search(r"([0-9.]+)M parameters", log)
    run["parameters_m"] = float(m.group(1)) if m else None
    m = re.search(r"model: built, initialised and wrapped in ([0-9.]+) s; peak RSS per rank "
                  r"([0-9, ]+) MiB \(([0-9, ]+) MiB before the model\)", log)
    run["setup_s"] = float(m.group(1)) if m else None
    run["setup_peak_rss_mib_per_rank"] = [int(x) for x in m.group(2).split(",")] if m else None
    run["rss_before_model_mib_per_rank"] = ([int(x) for x in m.group(3).split(",")] if m
                                            else None)
    steps = []
    for line in read(runs / f"{name}.jsonl").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") == "step":
            steps.append(record)
    run["steps"] = len(steps)
    run["peak_rss_mib_per_rank"] = ([round(x) for x in steps[-1]["peak_rss_mib_per_rank"]]
                                    if steps else None)
    if run["exit"] == 0 and steps:
        run["status"] = "ok"
    elif run["refusal"]:
        run["status"] = "refused"
    else:
        run["status"] = "failed"
    if run["status"] == "ok" and run["estimate_gib"] is not None:
        peak = max(run["peak_rss_mib_per_rank"])
        run["estimate_error_pct"] = round((run["estimate_gib"] * 1024 - peak) / peak * 100, 1)
    return run


def largest_unit(preset):
    d = DIM[preset]
    return VOCAB * d + CTX * d + 2 * d


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = pathlib.Path(sys.argv[1])
    runs = out / "runs"
    names = sorted(p.stem for p in runs.glob("*.cmd"))
    parsed = {n: parse_run(runs, n) for n in names}
    machine = read(runs / "machine.txt").strip()

    md = [machine.replace("\n", "; "), ""]
    md.append("| preset | strategy | ranks | --memory_per_rank (GiB) | estimate (GiB/rank) | "
              "peak RSS (MiB/rank, max) | every rank (MiB) | estimate vs peak |")
    md.append("| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |")
    rows = []
    for preset in PRESETS:
        for s, (label, n) in STRATEGIES.items():
            r = parsed.get(f"train-{preset}-{s}")
            if r is None:
                continue
            rows.append((preset, s, r))
            est = "" if r["estimate_gib"] is None else f"{r['estimate_gib']:.2f}"
            if r["status"] == "ok":
                peaks = r["peak_rss_mib_per_rank"]
                md.append(f"| `{preset}` | {label} | {n} | {r['memory_per_rank_gib']} | {est} | "
                          f"{max(peaks)} | {', '.join(map(str, peaks))} | "
                          f"{r['estimate_error_pct']:+.0f}% |")
            elif r["status"] == "refused":
                md.append(f"| `{preset}` | {label} | {n} | {r['memory_per_rank_gib']} | refused "
                          f"(estimate {est} GiB) | | | |")
            else:
                md.append(f"| `{preset}` | {label} | {n} | {r['memory_per_rank_gib']} | {est} | "
                          f"failed (exit {r['exit']}) | | |")
    errors = [abs(r["estimate_error_pct"]) for _, _, r in rows if r["status"] == "ok"]
    if errors:
        md += ["", f"Largest deviation of an estimate from the measured peak: {max(errors):.0f}%."]

    md += ["", "Largest preset trained within a budget per rank (measured peak RSS; "
           "\"estimate\": the planner refused the run here, its estimate fits):", "",
           "| strategy | " + " | ".join(f"{g} GiB" for g in LIMITS_GIB) + " |",
           "| --- |" + " --- |" * len(LIMITS_GIB)]
    largest = {}
    for s, (label, n) in STRATEGIES.items():
        cells = []
        for g in LIMITS_GIB:
            best = "none"
            for preset, rs, r in rows:
                if rs != s:
                    continue
                if r["status"] == "ok" and max(r["peak_rss_mib_per_rank"]) <= g * 1024:
                    best = f"`{preset}`"
                elif r["status"] == "refused" and r["estimate_gib"] <= g:
                    best = f"`{preset}` (estimate)"
            cells.append(best)
            largest[f"{s} x{n} within {g} GiB"] = best.replace("`", "")
        md.append(f"| {label} x{n} | " + " | ".join(cells) + " |")

    setup_rows = [r for n, r in parsed.items() if r["setup_s"] is not None and
                  (n.endswith("-fsdp"))]
    if setup_rows:
        md += ["", "Set-up under FSDP x4 (build, initialise or load, shard): rank 0's time; "
               "every rank's peak RSS until then, and the same less what the rank held before "
               "the model (libraries, data), against 1/N of the fp32 model plus its largest "
               "unit:", "",
               "| run | seconds | peak RSS at set-up (MiB/rank) | less the RSS before the model "
               "(MiB/rank) | 1/N fp32 + one unit (MiB) | ratio, model's part (max) | ratio, "
               "whole peak (max) |", "| --- | ---: | --- | --- | ---: | ---: | ---: |"]
        for r in setup_rows:
            preset = next((p for p in PRESETS if f"-{p}-" in r["name"]), None)
            if preset is None or r["parameters_m"] is None:
                continue
            n = len(r["setup_peak_rss_mib_per_rank"])
            bound = (r["parameters_m"] * 1e6 * 4 / n + 4 * largest_unit(preset)) / MIB
            model_part = [p - b for p, b in zip(r["setup_peak_rss_mib_per_rank"],
                                                r["rss_before_model_mib_per_rank"])]
            r["setup_model_part_mib_per_rank"] = model_part
            r["setup_bound_mib"] = round(bound)
            r["setup_ratio_model_part"] = round(max(model_part) / bound, 3)
            r["setup_ratio"] = round(max(r["setup_peak_rss_mib_per_rank"]) / bound, 3)
            md.append(f"| {r['name']} | {r['setup_s']:.2f} | "
                      f"{', '.join(map(str, r['setup_peak_rss_mib_per_rank']))} | "
                      f"{', '.join(map(str, model_part))} | {bound:.0f} | "
                      f"{r['setup_ratio_model_part']:.2f} | {r['setup_ratio']:.2f} |")

    fits = [r for n, r in parsed.items() if n.startswith("fit-")]
    if fits:
        md += ["", "Within --memory_per_rank (part `fit`, activation checkpointing):", ""]
        for r in fits:
            peaks = r["peak_rss_mib_per_rank"]
            md.append(f"- `{r['command']}`: {r['status']}, estimate {r['estimate_gib']} GiB, "
                      f"peak RSS per rank {', '.join(map(str, peaks or []))} MiB")

    refusals = [r for n, r in parsed.items() if n.startswith("refuse-")]
    if refusals:
        md += ["", "Refused up front:", ""]
        for r in refusals:
            md.append(f"- `{r['command']}`: exit {r['exit']}: {r['refusal'] or 'NOT refused'}")

    (out / "model-size.md").write_text("\n".join(md) + "\n")
    with open(out / "model-size.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["name", "status", "exit", "memory_per_rank_gib", "estimate_gib",
                    "peak_rss_mib_max", "peak_rss_mib_per_rank", "estimate_error_pct",
                    "setup_s", "setup_peak_rss_mib_per_rank"])
        for n, r in parsed.items():
            peaks = r["peak_rss_mib_per_rank"]
            setup = r["setup_peak_rss_mib_per_rank"]
            w.writerow([n, r["status"], r["exit"], r["memory_per_rank_gib"], r["estimate_gib"],
                        max(peaks) if peaks else "", " ".join(map(str, peaks or [])),
                        r.get("estimate_error_pct", ""), r["setup_s"] or "",
                        " ".join(map(str, setup or []))])
    (out / "model-size.json").write_text(json.dumps(
        {"machine": machine, "runs": parsed, "largest_preset": largest}, indent=1) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
