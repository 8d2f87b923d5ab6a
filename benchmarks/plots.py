"""PNG plots of the suite's JSON (benchmarks/run.py writes them; this re-draws them).

  python benchmarks/plots.py benchmarks/results/suite.json docs/images

Three figures, one panel per (layout, model) setup and one line per method, against k: time
per optimizer step (the large batch as a dashed line), gradient-reduction bytes per
optimizer step, compiled temp memory. Every title names the device that produced the data.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

MIB = 2**20
STYLE = {  # method -> (colour, marker, line style): fxaccum solid, baselines dashed
    "fxaccum": ("tab:blue", "o", "-"),
    "fxaccum_zero1": ("tab:cyan", "o", "-"),
    "fxaccum_zero2": ("tab:gray", "o", "-"),
    "fxaccum_cross": ("tab:green", "s", "-"),
    "fxaccum_cross_reduced": ("tab:olive", "s", "-"),
    "plain_scan": ("tab:orange", "^", "--"),
    "micro_grad": ("tab:purple", "v", "--"),
    "multisteps": ("tab:red", "D", "--"),
}
FIGURES = {  # file stem -> (y label, value of a record, log y axis)
    "bench_time": ("ms per optimizer step", lambda r: r["ms_per_step"], True),
    "bench_reduction_bytes": ("gradient-reduction MiB per optimizer step",
                              lambda r: r["grad_reduction_bytes_per_step"] / MIB, True),
    "bench_temp_memory": ("compiled temp MiB per device (one call)",
                          lambda r: (r["temp_bytes"] or 0) / MIB, False),
}


def plot_all(payload: dict[str, Any], folder: str) -> list[str]:
  """Writes the three figures to ``folder``; their paths."""
  os.makedirs(folder, exist_ok=True)
  setups = {n: s for n, s in payload["setups"].items() if "skipped" not in s}
  if not setups:
    return []
  versions = payload["versions"]
  device = (f"{payload['device_count']} x {payload['device_kind']} ({payload['platform']}), "
            f"JAX {versions['jax']}" + (", --quick" if payload["quick"] else ""))
  paths = []
  for stem, (label, value, log_y) in FIGURES.items():
    cols = min(2, len(setups))
    rows = -(-len(setups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    for ax, setup in zip(axes.flat, setups.values(), strict=False):
      for method, by_k in setup["results"].items():
        points = [(int(k), value(r)) for k, r in by_k.items() if "skipped" not in r]
        if points:
          colour, marker, line = STYLE.get(method, ("black", "x", ":"))
          ax.plot(*zip(*points, strict=True), color=colour, marker=marker, linestyle=line,
                  label=method)
      ref = value(setup["large_batch"])
      ax.axhline(ref, color="gray", linestyle=":", label="large_batch")
      ax.set_xscale("log", base=2)
      ax.set_xticks(payload["ks"], [str(k) for k in payload["ks"]])
      if log_y and ref > 0:
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")  # 200, not 2 x 10^2
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
      ax.set_xlabel("k (micro-batches per optimizer step)")
      ax.set_ylabel(label)
      mesh = "x".join(map(str, setup["mesh"]["shape"]))
      ax.set_title(f"{setup['layout']} / {setup['model']} (mesh {mesh})", fontsize=10)
      ax.grid(True, which="both", alpha=0.3)
      ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(setups):]:
      ax.set_visible(False)
    fig.suptitle(f"{label} vs k — on {device}", fontsize=11)
    fig.tight_layout()
    path = os.path.join(folder, f"{stem}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
  return paths


if __name__ == "__main__":
  if len(sys.argv) != 3:
    raise SystemExit(__doc__)
  with open(sys.argv[1]) as f:
    print("\n".join(plot_all(json.load(f), sys.argv[2])))
