"""The table and the chart of ``bench moe`` (matplotlib optional: without it no PNG, and a note)."""

from __future__ import annotations

from pathlib import Path

from .metrics import human_bytes


def format_table(rows: list[dict], floor: dict | None) -> str:
    head = (f"{'impl':<10}{'op':<9}{'dtype':<6}{'mode':<6}{'tokens':>7}{'rows':>8}{'bytes':>9}{'median us':>11}"
            f"{'p10':>9}{'p90':>9}{'GB/s':>8}{'correct':>8}")
    if floor:
        head += f"{'ceil us':>9}{'of ceil':>8}{'+us':>8}"
    head += f"{'HBM/rank':>10}"
    lines = [head]
    for r in rows:
        nbytes = human_bytes(r["bytes"]) if r.get("bytes") else "-"
        gbps = f"{r['GBps']:>8.1f}" if "GBps" in r else f"{'-':>8}"
        line = (f"{r['impl']:<10}{r['op']:<9}{r['dtype']:<6}{r['mode']:<6}{r['tokens']:>7}{r['rows']:>8}{nbytes:>9}"
                f"{r['time_us_median']:>11.1f}{r['time_us_p10']:>9.1f}{r['time_us_p90']:>9.1f}{gbps}"
                f"{'yes' if r['correct'] else 'NO':>8}")
        if floor:
            line += (f"{r['ceiling_us']:>9.1f}{r['of_ceiling']:>8.2f}{r['over_ceiling_us']:>8.1f}" if r.get("ceiling_us") is not None
                     else f"{'-':>9}{'-':>8}{'-':>8}")
        line += f"{human_bytes(r['hbm_bytes']) if r['hbm_bytes'] else '-':>10}"
        lines.append(line)
    legend = ("(times in us, slowest rank per iteration; bytes: payload moved, summed over ranks; rows: expert "
              "rows on the busiest rank")
    if floor:
        lines.append(legend + "; ceiling: 2 x bytes / device copy bandwidth; +us: median - ceiling)")
        lines.append(f"copy bandwidth {floor['copy_GBps']:.0f} GB/s ({floor['copy_measured']})")
    else:
        lines.append(legend + "; no ceiling columns: the copy rate they divide by is measured on a GPU only)")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> tuple[Path | None, str | None]:
    """Bars per (tokens, dtype): dispatch, combine, pair, torch reference; returns (path, note)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - any import failure means no plot
        return None, "install matplotlib for the chart (pip install 'purlin-sglang[bench]')"
    groups = sorted({(r["tokens"], r["dtype"]) for r in rows if r["impl"] == "purlin"})
    if not groups:
        return None, "no results to plot"
    labels = ["dispatch", "combine", "pair", "torch-ref"]
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(groups)), 4.5))
    width = 0.8 / len(labels)
    for i, lab in enumerate(labels):
        vals = []
        for tokens, dt in groups:
            if lab == "torch-ref":
                sel = [r for r in rows if r["impl"] == "torch-ref" and r["tokens"] == tokens]
            else:
                sel = [r for r in rows if r["impl"] == "purlin" and r["op"] == lab and (r["tokens"], r["dtype"]) ==
                       (tokens, dt)]
            vals.append(sel[0]["time_us_median"] if sel else 0.0)
        ax.bar([g + i * width for g in range(len(groups))], vals, width, label=lab)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"{t} tok/rank\n{dt}" for t, dt in groups])
    ax.set_yscale("log")
    ax.set_ylabel("time per call (us, median)")
    first = rows[0]
    ax.set_title(f"purlin MoE dispatch/combine, world {first['world']}, H {first['hidden']}, "
                 f"top-{first['topk']} of {first['experts']}, {first['mode']}")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except Exception as e:  # noqa: BLE001
        return None, f"plot {path.name} failed: {type(e).__name__}: {e}"
    finally:
        plt.close(fig)
    return path, None
