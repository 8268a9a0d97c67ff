"""The ``loopmap`` stage's two figures (matplotlib, Agg, PNG ≤ 1400 px wide at any dpi), drawn from its tables:

- ``rho_ftle.png``: ρ_t per loop (median and central interval over tokens, the line ρ = 1 where the certificate
  stops holding) and the FTLE λ_t per loop (median and interval over sequences, the line λ = 0 between contracting
  and expanding);
- ``windows.png``: each intervention's state effect e_j against the loops j after it (median, interval band) with
  its linearised prediction ê_j dashed beside it, the readout KL and the share of flipped argmaxes, each with its
  window threshold;
- ``trace.png``: the causal-tracing map — the restored fraction of the answer's logit difference per loop k ×
  position role (flipped, between, answer) — and the answer-flip depth beside the exit rules: each rule's mean exit
  depth against the share of tokens that exit before their flip depth (fixed depth d gives P(F > d)).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import polars as pl

#: Widest figure, in pixels (at any dpi).
MAX_PX = 1400


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _isolated(draw: Callable[..., Path]) -> Callable[..., Path]:
    """Draw under matplotlib's default style: rcParams are process-global, and another stage run in the same process
    (the report sets its fonts and grid) must not change these figures' bytes (same params → same bytes)."""
    @functools.wraps(draw)
    def wrapper(*args, **kwargs) -> Path:
        plt = _plt()
        with plt.style.context("default"):
            return draw(*args, **kwargs)

    return wrapper


def _figure(ncols: int, dpi: int):
    plt = _plt()
    width = min(12.5, MAX_PX / dpi)  # inches: ≤ MAX_PX pixels
    return plt.subplots(1, ncols, figsize=(width, width / 3.2), dpi=dpi)


def _save(fig, path: Path, dpi: int) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    _plt().close(fig)
    return path


@_isolated
def plot_rho_ftle(per_loop: pl.DataFrame, model: str, path: Path, dpi: int) -> Path:
    """ρ_t and λ_t per loop (module docstring)."""
    fig, (a, b) = _figure(2, dpi)
    loop = per_loop["loop"].to_numpy()
    a.fill_between(loop, per_loop["rho_lo"].to_numpy(), per_loop["rho_hi"].to_numpy(), alpha=0.25,
                   label="central interval over tokens")
    a.plot(loop, per_loop["rho_median"].to_numpy(), "o-", label="median ρ_t")
    a.axhline(1.0, color="k", lw=1, ls=":", label="ρ = 1 (no certificate above)")
    a.set_yscale("log")  # ρ spans orders of magnitude across loops (the first loop stretches most)
    a.set(xlabel="loop t", ylabel="ρ_t = σ_max(∂h_t[i]/∂h_{t−1}[i])", title=f"{model}: local contraction")
    a.legend(fontsize=8)
    b.fill_between(loop, per_loop["ftle_lo"].to_numpy(), per_loop["ftle_hi"].to_numpy(), alpha=0.25,
                   label="central interval over sequences")
    b.plot(loop, per_loop["ftle_median"].to_numpy(), "o-", label="median λ_t")
    b.plot(loop, per_loop["growth_median"].to_numpy(), "s--", lw=1, label="median log growth at loop t alone")
    b.axhline(0.0, color="k", lw=1, ls=":", label="λ = 0 (contracting below)")
    b.set(xlabel="loop t", ylabel="FTLE λ_t (nats / loop)", title="finite-time Lyapunov exponent")
    b.legend(fontsize=8)
    return _save(fig, path, dpi)


def _label(r: dict) -> str:
    return f"{'patch' if r['kind'] == 'patch' else 'noise ' + format(r['scale'], 'g')} @ k={r['loop']}"


@_isolated
def plot_windows(windows: pl.DataFrame, lengths: pl.DataFrame, model: str, path: Path, dpi: int) -> Path:
    """Every intervention's decay with loops after it (module docstring)."""
    import matplotlib

    fig, axes = _figure(3, dpi)
    keys = windows.select("kind", "scale", "loop").unique(maintain_order=True).to_dicts()
    colours = matplotlib.colormaps["tab10"]
    thr = {r["measure"]: r["threshold"] for r in lengths.iter_rows(named=True)}
    for i, key in enumerate(keys):
        sel = windows.filter((pl.col("kind") == key["kind"]) & (pl.col("loop") == key["loop"])
                             & (pl.col("scale").is_null() if key["scale"] is None else pl.col("scale") == key["scale"]))
        c = colours(i % 10)
        for ax, m in zip(axes, ("state", "kl", "flip"), strict=True):
            s = sel.filter(pl.col("measure") == m)
            j = s["j"].to_numpy()
            ax.plot(j, s["value"].to_numpy(), "o-", color=c, label=_label(key))
            ax.fill_between(j, s["lo"].to_numpy(), s["hi"].to_numpy(), color=c, alpha=0.12)
            if m == "state":
                lin = sel.filter(pl.col("measure") == "linear")
                ax.plot(lin["j"].to_numpy(), lin["value"].to_numpy(), "--", color=c, lw=1)
    titles = {"state": "state effect ‖h'−h‖/‖δ‖ (dashed: J^j δ)", "kl": "readout KL(p ‖ p') (nats)",
              "flip": "share of tokens whose argmax flipped"}
    for ax, m in zip(axes, ("state", "kl", "flip"), strict=True):
        if m in thr:
            ax.axhline(thr[m], color="k", lw=1, ls=":")
        if m == "state":
            ax.set_yscale("log")  # a geometric decay ρ^j is a line
        elif m == "kl":
            ax.set_yscale("symlog", linthresh=1e-4)  # exactly 0 for a size-0 intervention
            ax.set_ylim(bottom=0)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set(xlabel="loops j after the intervention", title=titles[m])
    axes[0].set_ylabel(model)
    axes[0].legend(fontsize=7)
    return _save(fig, path, dpi)


#: The trace map's rows, top to bottom (the table's other roles are in ``trace.parquet``).
TRACE_ROWS = ("flipped", "between", "answer", "other")


@_isolated
def plot_trace(trace: pl.DataFrame, flips: pl.DataFrame, model: str, path: Path, dpi: int) -> Path:
    """The causal-tracing map and the flip depth beside the exits (module docstring); the map's panel says so when
    nothing was traced."""
    import numpy as np

    fig, (a, b) = _figure(2, dpi)
    rows = [r for r in TRACE_ROWS if trace.height and r in set(trace["position"])]
    if rows:
        K = int(trace["loop"].max()) + 1  # type: ignore[arg-type]
        grid = np.full((len(rows), K), np.nan)
        for i, r in enumerate(rows):
            d = trace.filter(pl.col("position") == r)
            grid[i, d["loop"].to_numpy()] = d["restored"].to_numpy()
        seen = grid[np.isfinite(grid)]
        im = a.imshow(grid, aspect="auto", cmap="viridis", vmin=min(0.0, float(seen.min(initial=0.0))),
                      vmax=max(1.0, float(seen.max(initial=1.0))))
        a.set_yticks(range(len(rows)), rows)
        a.set_xticks(range(K))
        fig.colorbar(im, ax=a, label="restored fraction of LD")
        a.set(xlabel="patched loop k (0 = h_0, the injection)", title=f"{model}: causal tracing")
    else:
        a.text(0.5, 0.5, "not traced", ha="center", va="center", transform=a.transAxes)
        a.set_axis_off()
    flip = flips.filter(pl.col("rule") == "flip_depth").row(0, named=True)
    if np.isfinite(flip["depth_lo"]):
        b.axvspan(flip["depth_lo"], flip["depth_hi"], color="grey", alpha=0.2)
    b.axvline(flip["mean_depth"], color="k", lw=1, ls=":", label=f"mean flip depth {flip['mean_depth']:.2f}")
    for rule in flips["rule"].unique(maintain_order=True).to_list():
        if rule == "flip_depth":
            continue
        d = flips.filter(pl.col("rule") == rule).sort("mean_depth")
        x, y = d["mean_depth"].to_numpy(), d["share_before_flip"].to_numpy()
        b.plot(x, y, "*" if d.height == 1 else "o-", ms=10 if d.height == 1 else 4, label=rule)
    b.set(xlabel="mean exit depth", ylabel="share of tokens exiting before their flip depth",
          title="answer-flip depth vs exit depth")
    b.legend(fontsize=7)
    return _save(fig, path, dpi)


__all__ = ["MAX_PX", "TRACE_ROWS", "plot_rho_ftle", "plot_trace", "plot_windows"]
