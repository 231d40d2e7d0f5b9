"""Plots of a results table: per (mode, world), time vs size and busbw vs size, log-log.

matplotlib is optional (the ``bench`` extra); without it no plot is written and the caller
is told so. Never raises for plotting problems.
"""

from __future__ import annotations

from pathlib import Path


def plot_results(rows: list[dict], out_dir: Path) -> tuple[list[Path], str | None]:
    """Write ``plot-<mode>-world<w>.png`` files; return (paths, a note when none could be made)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - any import failure means no plots
        return [], "install matplotlib for plots (pip install 'purlin-sglang[bench]')"
    good = [r for r in rows if "error" not in r and r.get("time_us_median")]
    paths: list[Path] = []
    for mode, world in sorted({(r["mode"], r["world"]) for r in good}):
        sel = [r for r in good if r["mode"] == mode and r["world"] == world]
        fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(13, 5))
        colls = sorted({r["collective"] for r in sel})
        color = {c: f"C{i % 10}" for i, c in enumerate(colls)}
        for impl, coll in sorted({(r["impl"], r["collective"]) for r in sel}, key=lambda k: (k[0] != "purlin", k)):
            pts = sorted((r["bytes"], r["time_us_median"], r["busbw_GBps"]) for r in sel
                         if r["impl"] == impl and r["collective"] == coll)
            xs = [p[0] for p in pts]
            style = "-" if impl == "purlin" else ("--" if impl in ("nccl", "gloo") else ":")
            label = coll if impl == "purlin" else f"{coll} ({impl})"
            ax_t.plot(xs, [p[1] for p in pts], style, color=color[coll], marker=".", label=label)
            ax_b.plot(xs, [p[2] for p in pts], style, color=color[coll], marker=".", label=label)
        for ax, what in ((ax_t, "time per call (us)"), (ax_b, "busbw (GB/s)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("bytes (nccl-tests convention)")
            ax.set_ylabel(what)
            ax.grid(True, which="both", alpha=0.3)
        ax_b.legend(fontsize=7, loc="best")
        fig.suptitle(f"purlin_sglang collectives, {mode}, world {world}")
        fig.tight_layout()
        path = out_dir / f"plot-{mode}-world{world}.png"
        try:
            fig.savefig(path, dpi=110)
            paths.append(path)
        except Exception as e:  # noqa: BLE001
            return paths, f"plot {path.name} failed: {type(e).__name__}: {e}"
        finally:
            plt.close(fig)
    return paths, None
