"""A cost-curve file as a picture: `python -m minedraft.profile.plot FILE.json [...]` writes FILE.png beside each.

Left: every model's forward time against batch (one line per context and tokens per request); right: the drafters'
k-token draft loops against batch, and the target's k + 1-token verification for comparison. Log-log axes: a
memory-bound curve is flat, a compute-bound one rises with slope 1. matplotlib is imported here only, so the
profiler itself stays torch-only.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from minedraft.profile import curves


def _series(entries: list[dict[str, Any]], tokens_key: str) -> dict[tuple[int, int], list[tuple[int, float]]]:
    out: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for e in entries:
        out.setdefault((e["context"], e[tokens_key]), []).append((e["batch"], e["ms"]))
    return {key: sorted(points) for key, points in sorted(out.items())}


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    target = next(name for name, m in doc["models"].items() if m["role"] == "target")
    styles = ["-", "--", ":", "-."]
    for index, (name, model) in enumerate(doc["models"].items()):
        for (context, q), points in _series(model.get("forward_ms", []), "new_tokens").items():
            left.plot(*zip(*points, strict=True), marker="o", markersize=3, linestyle=styles[index % len(styles)],
                      label=f"{name} ctx {context}, {q} token{'s' if q > 1 else ''}")
        for (context, k), points in _series(model.get("draft_loop_ms", []), "k").items():
            right.plot(*zip(*points, strict=True), marker="o", markersize=3, linestyle=styles[index % len(styles)],
                       label=f"{name} draft k={k}, ctx {context}")
    ks = {e["k"] for m in doc["models"].values() for e in m.get("draft_loop_ms", [])}
    for (context, q), points in _series(doc["models"][target].get("forward_ms", []), "new_tokens").items():
        if q - 1 in ks:
            right.plot(*zip(*points, strict=True), color="black", alpha=0.5, linestyle=styles[(q - 1) % len(styles)],
                       label=f"{target} verify k={q - 1}, ctx {context}")
    for axis, title in ((left, "forward passes"), (right, "draft loops vs the target's verification")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("batch (requests)")
        axis.set_ylabel("ms")
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=6, ncol=2)
    fig.suptitle(f"{doc['device']}, {doc['dtype']}, {doc['execution']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    files = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    if not files:
        print("usage: python -m minedraft.profile.plot FILE.json [...]", file=sys.stderr)
        return 2
    for path in files:
        out = path.with_suffix(".png")
        plot(curves.read(path), out)
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
