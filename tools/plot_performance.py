"""Plot attention speed-up against the ideal pair reduction from bench_attention JSON files.

    python -m dualkv_compile.tools.plot_performance docs/results/attention_h100.json \
        docs/results/attention_long_h100.json --out docs/performance_speedup.png

One group of bars per shape (N, P, R): the ideal (the pair reduction) and each packed-op
backend's measured speed-up over the best dense SDPA kernel on the replicated batch. Files are
merged by shape; a backend measured in several files is taken from the first that has it (every
speed-up is a ratio from one run). Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="bench_attention JSON files (one GPU, one run each)")
    ap.add_argument("--out", required=True, help="PNG path")
    args = ap.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        ap.error("plotting needs matplotlib: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_shape, meta = {}, None
    for path in args.results:
        with open(path) as f:
            data = json.load(f)
        meta = meta or data["meta"]
        for r in data["rows"]:
            merged = by_shape.setdefault((r["N"], r["P"], r["R"]), {})
            for key, value in r.items():
                merged.setdefault(key, value)
    rows = list(by_shape.values())
    backends = sorted({k for r in rows for k in r if k.startswith("ours_")})
    labels = [f"{r['N']}x({r['P'] // 1024}K+{r['R'] // 1024 or r['R']}{'K' if r['R'] >= 1024 else ''})"
              for r in rows]
    series = [("ideal (pair reduction)", [r["pair_reduction"] for r in rows])]
    nan = float("nan")  # a missing measurement draws no bar (not a zero)
    series += [(b.replace("ours_", "ours, "), [r.get(b, {}).get("speedup_vs_best_dense") or nan
                                                for r in rows]) for b in backends]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(1.4 * len(rows) + 2, 4))
    for i, (name, values) in enumerate(series):
        ax.bar([x + i * width for x in range(len(rows))], values, width, label=name)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(rows))], labels,
                  rotation=20)
    ax.set_ylabel("fwd+bwd speed-up over best dense SDPA")
    ax.set_xlabel("N x (P + R)")
    ax.set_title(f"Shared-prefix attention, bf16, {meta['hq']}/{meta['hkv']} heads, D={meta['d']}, "
                 f"{meta['gpu']}, torch {meta['torch']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
