"""Digest of every artifact of the tiny end-to-end project, to check that a refactor keeps outputs byte-identical.

``python tests/output_digest.py <repo> > digest.json`` runs every dvc.yaml stage of ``<repo>`` (its code, its
params.yaml with tests/test_e2e_gates.TINY layered over it, dynamics on) in-process in a temporary directory and
prints ``{artifact path: sha256}``. Run it on two commits on one machine (a worktree each) and compare the two
JSON files. Normalised so that only values count: JSON without ``*seconds`` keys, the store's ``code_hash`` and
``fingerprint`` (hashes of the source, which any edit changes); latency/generate measured columns (wall clock)
dropped; ``model.pt`` digested by tensors and metadata without ``*seconds``. A tree of the old layout
(``pipeline/`` mapped onto ``looptrace`` by setuptools' package-dir) needs ``PYTHONPATH`` pointing at a folder
``looptrace/`` of links to its ``pipeline/*`` and ``stages``. ``--values`` digests Parquet files by their table
(not their encoding: page checksums change the bytes, not the values) and leaves out ``manifest.json`` (the files'
sha256).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

#: Columns of latency/generate outputs that are wall-clock measurements.
MEASURED = re.compile(r"(_s|_per_s|realised_speedup|speedup_ratio|ratio_to_work_ideal)$")
MEASURED_STAGES = ("latency", "generate")
#: JSON keys that hash source code (any edit changes them), not values.
SOURCE_KEYS = ("code_hash", "fingerprint")


def clean(o):
    if isinstance(o, dict):
        return {k: clean(v) for k, v in o.items() if not k.endswith("seconds") and k not in SOURCE_KEYS}
    if isinstance(o, list):
        return [clean(v) for v in o]
    return o


def skeleton(o):
    if isinstance(o, dict):
        return {k: skeleton(v) for k, v in o.items()}
    return len(o) if isinstance(o, list) else None


def digest(p: Path, stage: str, values: bool = False) -> str:
    import polars as pl
    import torch

    if p.suffix == ".json":
        d = json.loads(p.read_text())
        b = json.dumps(skeleton(d) if stage in MEASURED_STAGES else clean(d), sort_keys=True).encode()
    elif p.suffix == ".parquet" and values and stage not in MEASURED_STAGES:  # the table, not its encoding
        b = json.dumps(pl.read_parquet(p).to_dicts(), default=str).encode()
    elif p.suffix == ".parquet" and stage in MEASURED_STAGES:
        df = pl.read_parquet(p)
        b = json.dumps(df.drop([c for c in df.columns if MEASURED.search(c)]).to_dicts(), default=str).encode()
    elif p.suffix == ".pt":
        h = hashlib.sha256()

        def walk(o, key=""):
            if isinstance(o, torch.Tensor):
                h.update(key.encode() + o.detach().cpu().contiguous().numpy().tobytes())
            elif isinstance(o, dict):
                for k in sorted(o, key=str):
                    if not str(k).endswith("seconds"):
                        walk(o[k], f"{key}/{k}")
            elif isinstance(o, (list, tuple)):
                for i, v in enumerate(o):
                    walk(v, f"{key}/{i}")
            else:
                h.update(f"{key}={o!r}".encode())

        walk(torch.load(p, map_location="cpu", weights_only=False))
        return h.hexdigest()
    else:
        b = p.read_bytes()
    return hashlib.sha256(b).hexdigest()


def main(repo: Path, values: bool = False) -> dict[str, str]:
    sys.path[:0] = [str(repo / "pipeline"), str(repo)] if (repo / "pipeline" / "looptrace").is_dir() else [str(repo)]
    import yaml

    from tests.test_e2e_gates import TINY, _merge, run_in_process, stage_commands

    tmp = Path(tempfile.mkdtemp(prefix="output-digest-"))
    shutil.copy(repo / "dvc.yaml", tmp / "dvc.yaml")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    over = {**TINY, "dynamics": {"enabled": True, "probe_sequences": 32}}
    params = {k: _merge(v, over[k]) if k in over and isinstance(v, dict) else v for k, v in params.items()}
    (tmp / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    os.environ.update({"SOURCE_DATE_EPOCH": "0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    for name, cmd in stage_commands(yaml.safe_load((tmp / "dvc.yaml").read_text()), params):
        print("run", name, file=sys.stderr)
        run_in_process(cmd, tmp)
    out = {}
    for p in sorted((tmp / "artifacts").rglob("*")):
        if p.is_file() and not (values and p.name == "manifest.json"):
            rel = p.relative_to(tmp / "artifacts")
            out[str(rel)] = digest(p, rel.parts[0], values)
    print(f"{len(out)} files under {tmp}", file=sys.stderr)
    return out


if __name__ == "__main__":
    json.dump(main(Path(sys.argv[1]).resolve(), values="--values" in sys.argv[2:]), sys.stdout, indent=0,
              sort_keys=True)
