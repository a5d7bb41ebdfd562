#!/usr/bin/env python3
"""benchmarks/trace_table.py on hand-made traces whose figures are known."""
import io, json, os, sys, tempfile, unittest
from contextlib import redirect_stdout

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "benchmarks"))
import trace_table  # noqa: E402


def ev(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 0}


# Two steps. GPU: kernels A [0,10) and B [5,20) overlap (busy 20), a copy [30,40), kernel A
# [100,110): busy 40 over the span [0,110), idle 70. Host: one stream sync, one device sync,
# an asynchronous copy (not a sync), two scalar reads among four ATen events.
DTRAIN = [ev("kernel", "A", 0, 10), ev("kernel", "B", 5, 15), ev("gpu_memcpy", "copy", 30, 10),
          ev("kernel", "A", 100, 10), ev("cuda_runtime", "cudaStreamSynchronize", 50, 5),
          ev("cuda_runtime", "cudaDeviceSynchronize", 120, 5),
          ev("cuda_runtime", "cudaMemcpyAsync", 40, 1), ev("cpu_op", "aten::mm", 0, 3),
          ev("cpu_op", "aten::_local_scalar_dense", 49, 7),
          ev("cpu_op", "aten::_local_scalar_dense", 119, 7), ev("cpu_op", "aten::add_", 60, 1),
          {"ph": "i", "cat": "kernel", "name": "instant, not counted", "ts": 500}]
# Older Kineto's capitalised categories; one kernel per step.
TORCH = [ev("Kernel", "A", 0, 4), ev("Kernel", "A", 10, 4), ev("Runtime", "cudaMemcpy", 20, 1),
         ev("Operator", "aten::mm", 0, 1)]


class TraceTable(unittest.TestCase):
    def test_figures(self):
        d = trace_table.summarize(DTRAIN, 2)
        self.assertEqual(d["kernels_per_step"], 1.5)
        self.assertAlmostEqual(d["gpu_busy_ms_per_step"], 0.020)
        self.assertAlmostEqual(d["gpu_idle_ms_per_step"], 0.035)
        self.assertEqual(d["host_syncs_per_step"], 1.0)
        self.assertEqual(d["local_scalar_dense_per_step"], 1.0)
        self.assertEqual(d["aten_ops_per_step"], 2.0)
        self.assertEqual(d["kernels"]["A"], {"calls_per_step": 1.0, "ms_per_step": 0.010})
        t = trace_table.summarize(TORCH, 2)
        self.assertEqual(t["kernels_per_step"], 1.0)
        self.assertAlmostEqual(t["gpu_idle_ms_per_step"], 0.003)
        self.assertEqual(t["host_syncs_per_step"], 0.5)

    def test_cli_table(self):
        with tempfile.TemporaryDirectory() as tmp:
            paths = []
            for name, events in (("d.json", DTRAIN), ("t.json", {"traceEvents": TORCH})):
                paths.append(os.path.join(tmp, name))
                with open(paths[-1], "w") as f:
                    json.dump(events, f)
            out = io.StringIO()
            with redirect_stdout(out):
                rc = trace_table.main(["--dtrain", paths[0], "--torch", paths[1], "--steps", "2",
                                       "--json_out", os.path.join(tmp, "s.json"),
                                       "--md_out", os.path.join(tmp, "s.md")])
            self.assertEqual(rc, 0)
            text = out.getvalue()
            self.assertIn("| kernels | 2 | 1 | 1.50 |", text)
            self.assertIn("| host syncs | 1.0 | 0.5 | 2.00 |", text)
            # A (20 us over both steps on dtrain's side) ranks above B (15 us).
            self.assertLess(text.index("| `A` |"), text.index("| `B` |"))
            self.assertIn("| `B` | 0.007 | 0.5 | - | 0 |", text)
            with open(os.path.join(tmp, "s.md")) as f:
                self.assertEqual(f.read(), text)
            with open(os.path.join(tmp, "s.json")) as f:
                self.assertEqual(json.load(f)["pytorch"]["kernels_per_step"], 1.0)


if __name__ == "__main__":
    unittest.main()
