"""Loop self-speculative decoding on a Hugging Face looped LM through the LM recipe: predicted vs realised.

The repository's LM profile (params.yaml + profiles/lm/params.yaml) on the tiny Ouro stand-in of the adapter tests
(``tests/hf_helpers.build_ouro``: Ouro's interfaces, its exit gate and its cache, random weights, 4 loops; or
``--model huginn``, the Huginn stand-in: prelude, a core of 2 layers run 4 times, coda) and a
small generated corpus, with ``generate.speculative`` on: ``looptrace dump`` -> ``geometry`` -> ``readouts`` ->
``gates`` -> ``diagnose`` -> ``generate`` -> ``report``, through the CLI, as a user of a real checkpoint runs it.
Writes every artifact under ``--out`` (``artifacts/generate/speculative.parquet``: realised and predicted
acceptance and speedup per draft loops k × draft length d × batch size; ``artifacts/report/index.html`` with the
"Speed: lossless vs lossy" section, ``figures/speed.png`` and ``figures/layers.png``: the block's two layers are
dumped every loop, ``dump.layers: [0, 1]``) and prints, per (k, d, batch size), the tokens per
verified block and the speedup, realised and predicted from the store (SPEC §8), and realised / predicted (the
target on CPU: ≥ 0.9).

A random-weight model is a mechanism check, not a finding: its argmax at k loops rarely equals its argmax at T, so
drafts are rejected and speculation is slower than full depth — which the prediction from the store says before
any decoding is timed. The timing is of a tiny model on CPU, where per-call overhead dominates.

Usage: ``python benchmarks/speculative_lm.py [--out DIR --spec 1:2,2:2,3:2 --repeats 3]`` (~1 min, 1 core).
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.hf_helpers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="a new or empty directory for the run's artifacts "
                    "(default: a new temporary one)")
    ap.add_argument("--spec", default="1:2,2:2,3:2", help="draft loops k : draft length d, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes of each decode (median)")
    ap.add_argument("--sequences", type=int, default=32, help="packed sequences per split (fit, val, test)")
    ap.add_argument("--model", default="ouro", choices=("ouro", "huginn"),
                    help="the stand-in: ouro (2 shared layers x 4 loops, exit gate) or huginn (prelude 1, core 2 x 4, "
                         "coda 1)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (8 sequences, one setting, one repeat)")
    args = ap.parse_args()
    if args.smoke:
        args.spec, args.repeats, args.sequences = "2:2", 1, 8

    import polars as pl
    from typer.testing import CliRunner

    from looptrace.cli import app
    from tests.hf_helpers import build_huginn, build_ouro, corpus, lm_params

    pairs = [tuple(int(x) for x in s.split(":")) for s in args.spec.split(",") if s]
    out = args.out or Path(tempfile.mkdtemp(prefix="speculative-lm-"))
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        sys.exit(f"--out {out}: not empty; give a new directory")
    build = {"ouro": build_ouro, "huginn": build_huginn}[args.model]
    params = lm_params(out, build(out / args.model), corpus(out / "corpus.jsonl", n=200), kind=args.model,
                       trust_remote_code=True)
    p = yaml.safe_load(params.read_text())
    p["dump"]["text"]["seq_len"] = 32
    n = args.sequences
    # both shared layers of the block every loop: geometry's layers.parquet and the report's figures/layers.png for
    # a Hugging Face model (per-head statistics need looptrace's own attention module: not for an adapter)
    p["dump"].update(sequences={"fit": n, "val": n, "test": n}, batch_size=8, layers=[0, 1])
    p["generate"].update(prompts=8, prompt_len=8, new_tokens=12, batch_sizes=[1, 8], repeats=args.repeats,
                         speculative={"k": sorted({k for k, _ in pairs}), "d": sorted({d for _, d in pairs}),
                                      "cost_repeats": 5})
    params.write_text(yaml.safe_dump(p, sort_keys=False))
    art = out / "artifacts"
    runner = CliRunner()
    for cmd in (["dump", "--out", str(art / "dump")],
                ["geometry", "--model", "tiny", "--dump-root", str(art / "dump"), "--out", str(art / "geometry")],
                ["readouts", "--model", "tiny", "--geometry-root", str(art / "geometry"), "--out",
                 str(art / "readouts")],
                ["gates", "--models", "tiny", "--dump-root", str(art / "dump"), "--out", str(art / "gates")],
                ["diagnose", "--models", "tiny", "--readouts-root", str(art / "readouts"), "--gates-root",
                 str(art / "gates"), "--geometry-root", str(art / "geometry"), "--out", str(art / "diagnose")],
                ["generate", "--dump-root", str(art / "dump"), "--readouts-root", str(art / "readouts"),
                 "--gates-root", str(art / "gates"), "--out", str(art / "generate")],
                ["report", "--models", "tiny", "--root", str(art), "--out", str(art / "report")]):
        res = runner.invoke(app, [*cmd, "--params", str(params)])
        if res.exit_code:
            sys.exit(f"looptrace {cmd[0]} failed ({res.exit_code}):\n{res.output[-2000:]}")
    spec = pl.read_parquet(art / "generate" / "speculative.parquet")
    print(f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"tiny {args.model} stand-in (random weights, T = {int(spec['n_loops'][0])}); artifacts: {art}")
    print("k  d  batch  exact  tokens/block realised  predicted [95 %]        speedup realised [min, max]   "
          "predicted [95 %]       realised/predicted")
    for r in spec.sort(["batch_size", "k", "d"]).iter_rows(named=True):
        print(f"{r['k']}  {r['d']}  {r['batch_size']:>5}  {str(r['exact']):5}  {r['realised_tokens_per_block']:>21.3f}  "
              f"{r['predicted_tokens_per_block']:.3f} [{r['predicted_tokens_per_block_lo']:.3f}, "
              f"{r['predicted_tokens_per_block_hi']:.3f}]  {r['realised_speedup']:>16.3f} "
              f"[{r['realised_speedup_lo']:.3f}, {r['realised_speedup_hi']:.3f}]  {r['predicted_speedup']:.3f} "
              f"[{r['predicted_speedup_lo']:.3f}, {r['predicted_speedup_hi']:.3f}]  {r['speedup_ratio']:>8.2f}")


if __name__ == "__main__":
    main()
