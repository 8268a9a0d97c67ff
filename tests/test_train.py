"""Training: determinism, artifacts, checkpoints, metrics consistent with an independent evaluation."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from looptrace.cli import app
from looptrace.config import ConfigError
from looptrace.models.interface import file_sha256
from looptrace.models.looped import load_checkpoint
from looptrace.models.train import evaluate, lr_at, train_model
from tests.builders import tiny_train_config


def test_lr_schedule():
    cfg = tiny_train_config(steps=100, lr=1e-3, min_lr=1e-4, warmup=10)
    assert np.isclose(lr_at(0, cfg), 1e-4) and np.isclose(lr_at(9, cfg), 1e-3)
    assert np.isclose(lr_at(55, cfg), 1e-4 + 0.5 * 9e-4) and np.isclose(lr_at(100, cfg), 1e-4)


def test_train_is_deterministic_and_writes_artifacts(tmp_path, tiny_base):
    cfg = tiny_train_config(steps=20)
    m1 = train_model(tiny_base, cfg, "rp", "joint", tmp_path / "a", progress=False)
    m2 = train_model(tiny_base, cfg, "rp", "joint", tmp_path / "b", progress=False)
    a, ck = load_checkpoint(tmp_path / "a" / "model.pt")
    b, _ = load_checkpoint(tmp_path / "b" / "model.pt")
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), n
    assert m1["val"] == m2["val"]
    assert ck["regime"]["kind"] == "joint" and a.gate is not None and ck["seed"] == 0
    assert ck["data_seeds"] == {"fit": 42, "val": 43, "test": 44} and "torch" in ck["versions"]
    saved = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert saved["val"]["acc_per_loop"] == m1["val"]["acc_per_loop"]
    assert len(saved["val"]["acc_per_loop"]) == 4
    # val has no prefix of length 1..6: at most 64 of each, training-only (tasks.FIT_ONLY_MAX)
    assert set(saved["val_acc_by_difficulty"]) == {"7", "8"}
    ckpts = sorted((tmp_path / "a" / "checkpoints").glob("*.pt"))
    assert [p.name for p in ckpts] == ["step_000010.pt"]
    # wall-clock figures stay out of model.pt (its sha256 is the checkpoint hash): the two runs wrote equal bytes
    assert "train_seconds" in saved and "train_seconds" not in ck["metrics"] and "train_cpu_seconds" not in ck["metrics"]
    assert file_sha256(tmp_path / "a" / "model.pt") == file_sha256(tmp_path / "b" / "model.pt")


def test_evaluate_matches_manual_accuracy(tiny_base):
    torch.manual_seed(0)
    cfg = tiny_train_config()
    task = cfg.task("mano")
    from looptrace.models.looped import LoopedTransformer
    from looptrace.models.train import build_model_config

    model = LoopedTransformer(build_model_config(cfg.model, task, cfg.regime("uniform"))).eval()
    data = task.dataset("val", 100, 43)
    ev = evaluate(model, data, batch_size=7)
    with torch.no_grad():
        z = model(torch.from_numpy(data.tokens)).logits[:, -1]  # only '=' is scored: [B, T, V]
    y = torch.from_numpy(data.targets[:, -1])
    acc = (z.argmax(-1) == y[:, None]).float().mean(0)
    assert np.allclose(ev["acc_per_loop"], acc.numpy(), atol=1e-9)
    d = data.difficulty[:, -1]
    acc2 = (z.argmax(-1) == y[:, None]).float()[torch.from_numpy(d == 2)].mean(0)
    assert np.allclose(ev["acc_by_difficulty"]["2"], acc2.numpy())


def test_cli_train_and_errors(tmp_path, repo_root):
    params = tmp_path / "params.yaml"
    params.write_text(
        "base: {seed: 1, threads: 1}\n"
        "train:\n  steps: 4\n  batch_size: 8\n  warmup: 1\n  val_sequences: 16\n  checkpoint_fractions: []\n"
        "  task_defs: {rp: {kind: running_parity, length: 6}}\n  regime_defs: {u: {kind: uniform}}\n"
        "  model: {d_model: 8, n_head: 2, groups: [{n_layer: 1, loops: 2}]}\n"
    )
    runner = CliRunner()
    res = runner.invoke(app, ["train", "--task", "rp", "--regime", "u", "--params", str(params),
                              "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "out" / "rp-u" / "model.pt").is_file()
    res = runner.invoke(app, ["train", "--task", "nope", "--regime", "u", "--params", str(params)])
    assert res.exit_code == 2 and "task 'nope' is not defined" in res.output
    params.write_text("train:\n  stepz: 3\n")
    res = runner.invoke(app, ["train", "--task", "rp", "--regime", "u", "--params", str(params)])
    assert res.exit_code == 2 and "unknown key 'stepz' in params section 'train'" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_seed_axis_models_equal_lone_training(tmp_path, tiny_base):
    """train.seeds in parallel worker processes: each model is bit-for-bit the seed trained alone (same thread
    count), named <task>-<regime>-s<seed>, carrying its seed; different seeds give different models."""
    import dataclasses

    from looptrace.models.train import train_seeds
    from looptrace.project import model_name

    cfg = dataclasses.replace(tiny_train_config(steps=12), seeds=(3, 5), workers=2, checkpoint_fractions=())
    assert cfg.model_threads(tiny_base) == 1 and model_name("rp", "uniform", 3) == "rp-uniform-s3"
    ms = train_seeds(tiny_base, cfg, [("rp", "uniform")], tmp_path / "ens")
    assert [m["model"] for m in ms] == ["rp-uniform-s3", "rp-uniform-s5"]
    alone = train_model(tiny_base, cfg, "rp", "uniform", tmp_path / "alone", progress=False, seed=5, threads=1)
    assert alone["model"] == "rp-uniform-s5" and alone["val"] == ms[1]["val"]
    a, ck = load_checkpoint(tmp_path / "alone" / "model.pt")
    b, ckb = load_checkpoint(tmp_path / "ens" / "rp-uniform-s5" / "model.pt")
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), n
    assert (ck["seed"], ck["threads"], ckb["seed"], ckb["name"]) == (5, 1, 5, "rp-uniform-s5")
    c, ckc = load_checkpoint(tmp_path / "ens" / "rp-uniform-s3" / "model.pt")
    assert ckc["seed"] == 3 and not torch.equal(c.head.weight, b.head.weight)
    with pytest.raises(ConfigError, match="duplicates"):
        dataclasses.replace(cfg, seeds=(1, 1))


def test_loop_form_reaches_the_model(tmp_path, tiny_base):
    import dataclasses

    cfg = tiny_train_config(steps=3, checkpoint_fractions=())
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, loop_form="norm_add"))
    train_model(tiny_base, cfg, "rp", "uniform", tmp_path / "m", progress=False)
    m, ck = load_checkpoint(tmp_path / "m" / "model.pt")
    assert m.cfg.loop_form == "norm_add" and ck["model_config"]["loop_form"] == "norm_add" and ck["name"] == "rp-uniform"


class _Killed(Exception):
    """Stands in for a SIGKILL at a chosen training step (the subprocess kill harness does the real one)."""


def _kill_at(monkeypatch, n_calls: int) -> list:
    """Make the ``n_calls``-th loss computation raise; returns the call log."""
    import looptrace.models.train as train_mod

    calls, real = [], train_mod.regime_loss

    def loss(*a, **k):
        calls.append(1)
        if len(calls) == n_calls:
            raise _Killed
        return real(*a, **k)

    monkeypatch.setattr(train_mod, "regime_loss", loss)
    return calls


def test_killed_train_resumes_bit_identical(tmp_path, tiny_base, monkeypatch):
    from looptrace.models.train import staging_dir

    cfg = tiny_train_config(steps=20, checkpoint_fractions=(0.25, 0.5))  # kept at steps 5 and 10
    train_model(tiny_base, cfg, "rp", "joint", tmp_path / "ref", progress=False)
    out = tmp_path / "m"
    calls = _kill_at(monkeypatch, 13)  # killed during step 13: the last resume state is step 10's
    with pytest.raises(_Killed):
        train_model(tiny_base, cfg, "rp", "joint", out, progress=False)
    assert not out.exists() and (staging_dir(out) / "resume.pt").is_file()  # nothing half-written is visible
    # saves a kill cut short (a checkpoint, the resume state) must not be swapped in with the finished run
    (staging_dir(out) / "checkpoints" / "step_000015.pt.tmp").write_bytes(b"cut")
    (staging_dir(out) / "resume.pt.tmp").write_bytes(b"cut")
    calls.clear()
    monkeypatch.undo()
    calls = _kill_at(monkeypatch, 10**9)
    train_model(tiny_base, cfg, "rp", "joint", out, progress=False)
    assert len(calls) == 10  # steps 11..20 only: it resumed, not started over
    assert file_sha256(out / "model.pt") == file_sha256(tmp_path / "ref" / "model.pt")
    for name in ("step_000005.pt", "step_000010.pt"):
        assert file_sha256(out / "checkpoints" / name) == file_sha256(tmp_path / "ref" / "checkpoints" / name)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000005.pt", "step_000010.pt"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "manifest.json", "metrics.json", "model.pt"]
    ref = json.loads((tmp_path / "ref" / "metrics.json").read_text())
    got = json.loads((out / "metrics.json").read_text())
    assert got["history"] == ref["history"] and got["final_train_loss"] == ref["final_train_loss"]
    assert not staging_dir(out).exists()


def test_retrain_replaces_the_whole_model_dir(tmp_path, tiny_base, monkeypatch):
    """A retrain with other params never mixes its checkpoints with the earlier run's, even when killed: the
    earlier run stays whole until the new one is done, and another run's resume state is not continued."""
    from looptrace.models.train import staging_dir

    out = tmp_path / "m"
    train_model(tiny_base, tiny_train_config(steps=20, checkpoint_fractions=(0.25, 0.5)), "rp", "joint", out,
                progress=False)
    first = file_sha256(out / "model.pt")
    other = tiny_train_config(steps=16, checkpoint_fractions=(0.5,))
    _kill_at(monkeypatch, 12)
    with pytest.raises(_Killed):
        train_model(tiny_base, other, "rp", "joint", out, progress=False)
    assert file_sha256(out / "model.pt") == first  # the earlier run is intact while the new one is unfinished
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000005.pt", "step_000010.pt"]
    monkeypatch.undo()
    calls = _kill_at(monkeypatch, 10**9)
    # a third params set: the killed run's resume state (other fingerprint) is discarded, training starts over
    third = tiny_train_config(steps=12, checkpoint_fractions=(0.5,))
    train_model(tiny_base, third, "rp", "joint", out, progress=False)
    assert len(calls) == 12
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000006.pt"]
    ck = torch.load(out / "model.pt", weights_only=True)
    assert ck["step"] == 12 and not staging_dir(out).exists()
    train_model(tiny_base, third, "rp", "joint", tmp_path / "fresh", progress=False)
    assert file_sha256(out / "model.pt") == file_sha256(tmp_path / "fresh" / "model.pt")
