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
    from looptrace.models.train import StopConfig

    cfg = tiny_train_config(steps=100, lr=1e-3, min_lr=1e-4, warmup=10)
    assert np.isclose(lr_at(0, cfg), 1e-4) and np.isclose(lr_at(9, cfg), 1e-3)
    assert np.isclose(lr_at(55, cfg), 1e-4 + 0.5 * 9e-4) and np.isclose(lr_at(100, cfg), 1e-4)
    assert lr_at(99, cfg) > 1e-4 and lr_at(150, cfg) == 1e-4  # past the schedule: min_lr held (stop.hold null)
    again = tiny_train_config(steps=100, lr=1e-3, min_lr=1e-4, warmup=10,
                              stop=StopConfig(target=0.9, hold=0.0))
    assert [lr_at(n, again) for n in (0, 9, 55, 99)] == [lr_at(n, cfg) for n in (0, 9, 55, 99)]
    assert np.isclose(lr_at(100, again), 1e-4) and np.isclose(lr_at(109, again), 1e-3)  # hold 0: warm-up again
    assert np.isclose(lr_at(155, again), 1e-4 + 0.5 * 9e-4) and np.isclose(lr_at(255, again), 1e-4 + 0.5 * 9e-4)
    held = tiny_train_config(steps=100, lr=1e-3, min_lr=1e-4, warmup=10, stop=StopConfig(target=0.9, hold=0.3))
    assert [lr_at(n, held) for n in (100, 129)] == [1e-4, 1e-4] and np.isclose(lr_at(139, held), 1e-3)
    assert np.isclose(lr_at(185, held), 1e-4 + 0.5 * 9e-4) and lr_at(255, held) == 1e-4
    assert (held.stop.cap(100), again.stop.cap(100), cfg.stop.cap(100)) == (260, 200, 100)  # 2 periods; no target


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
    res = runner.invoke(app, ["train", "--task", "rp", "--params", str(params)])
    assert res.exit_code == 2 and "give --task and --regime" in res.output and len(res.output.strip().splitlines()) == 1
    # no --task/--regime: every model of the matrix (here train.tasks x train.regimes, no seed axis: rp-u), which the
    # run above already trained with these params: kept as it is
    params.write_text(params.read_text().replace("train:\n", "train:\n  tasks: [rp]\n  regimes: [u]\n"))
    res = runner.invoke(app, ["train", "--params", str(params), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0 and res.output.startswith("rp-u: up to date (budget at step 4, val accuracy per loop")
    params.write_text("train:\n  stepz: 3\n")
    res = runner.invoke(app, ["train", "--task", "rp", "--regime", "u", "--params", str(params)])
    assert res.exit_code == 2 and "unknown key 'stepz' in params section 'train'" in res.output
    assert len(res.output.strip().splitlines()) == 1


def _files(root):
    """Every file under ``root`` (relative path -> bytes), metrics.json without its wall-clock fields and the manifest
    without its digest of metrics.json (the one file holding them)."""
    out = {}
    for f in sorted(root.rglob("*")):
        if not f.is_file():
            continue
        rel = f.relative_to(root).as_posix()
        if f.name == "metrics.json":
            out[rel] = {k: v for k, v in json.loads(f.read_text()).items() if not k.endswith("seconds")}
        elif f.name == "manifest.json":
            doc = json.loads(f.read_text())
            out[rel] = {**doc, "files": {k: v for k, v in doc["files"].items() if not k.endswith("metrics.json")}}
        else:
            out[rel] = f.read_bytes()
    return out


def test_pool_writes_the_bytes_of_a_serial_run(tmp_path, tiny_base):
    """The matrix (2 regimes x 2 seeds, criterion on) trained one after another in this process and in a pool of 2
    spawned processes: identical model.pt, checkpoints and metrics (but wall time); a seed trained alone with
    train_model is the same model too; different seeds differ. A second run finds every model up to date."""
    import dataclasses

    from looptrace.models.train import StopConfig, train_models
    from looptrace.project import model_name

    cfg = tiny_train_config(steps=24, regimes=("uniform", "joint"), seeds=(3, 5), checkpoint_fractions=(0.5,),
                            stop=StopConfig(target=0.99, patience=2, every=8, hold=0.5, cycles=1))
    assert cfg.model_threads(tiny_base.threads) == 1 and model_name("rp", "uniform", 3) == "rp-uniform-s3"
    assert cfg.matrix() == [("rp", "uniform", 3), ("rp", "uniform", 5), ("rp", "joint", 3), ("rp", "joint", 5)]
    serial = train_models(tiny_base, dataclasses.replace(cfg, workers=1), cfg.matrix(), tmp_path / "serial",
                          progress=False)
    lines: list[str] = []
    pooled = train_models(tiny_base, dataclasses.replace(cfg, workers=2), cfg.matrix(), tmp_path / "pool",
                          progress=False, echo=lines.append)
    assert [m["model"] for m in pooled] == ["rp-uniform-s3", "rp-uniform-s5", "rp-joint-s3", "rp-joint-s5"]
    assert len(lines) == 4 and all("val accuracy per loop" in line for line in lines)
    a, b = _files(tmp_path / "serial"), _files(tmp_path / "pool")
    assert sorted(a) == sorted(b) and "rp-joint-s5/checkpoints/step_000012.pt" in a
    differ = [k for k in a if a[k] != b[k]]
    assert differ == [], {k: sorted(key for key in a[k] if a[k][key] != b[k].get(key)) if isinstance(a[k], dict)
                          else "bytes" for k in differ}
    assert [m["steps"] for m in serial] == [m["steps"] for m in pooled] == [36] * 4  # never 0.99: the cap, 24 + 12
    assert {m["stop"]["reason"] for m in pooled} == {"step_cap"}
    alone = train_model(tiny_base, cfg, "rp", "joint", tmp_path / "alone" / "rp-joint-s5", progress=False, seed=5)
    assert alone["val"] == pooled[3]["val"]
    assert file_sha256(tmp_path / "alone" / "rp-joint-s5" / "model.pt") == \
        file_sha256(tmp_path / "pool" / "rp-joint-s5" / "model.pt")
    c, ckc = load_checkpoint(tmp_path / "pool" / "rp-joint-s3" / "model.pt")
    d, ckd = load_checkpoint(tmp_path / "pool" / "rp-joint-s5" / "model.pt")
    assert (ckc["seed"], ckd["seed"], ckd["threads"], ckd["name"]) == (3, 5, 1, "rp-joint-s5")
    assert not torch.equal(c.head.weight, d.head.weight)
    # the checkpoint records the model's recipe, not the matrix: no seeds/workers, its own task's steps
    assert "seeds" not in ckd["train"] and "workers" not in ckd["train"] and ckd["train"]["steps"] == 24
    assert ckd["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    lines.clear()
    again = train_models(tiny_base, dataclasses.replace(cfg, workers=2), cfg.matrix(), tmp_path / "pool",
                         progress=False, echo=lines.append)
    assert all(": up to date (" in line for line in lines) and again == [
        json.loads((tmp_path / "pool" / m["model"] / "metrics.json").read_text()) for m in pooled]
    with pytest.raises(ConfigError, match="duplicates"):
        dataclasses.replace(cfg, seeds=(1, 1))


def _first_stop(history: list[dict], target: float, patience: int, every: int) -> int | None:
    """The criterion by hand: the step of the first evaluation (every ``every`` steps) completing ``patience``
    consecutive full-depth accuracies >= ``target``."""
    run = 0
    for h in history:
        if h["step"] % every:
            continue
        run = run + 1 if h["acc_per_loop"][-1] >= target else 0
        if run >= patience:
            return h["step"]
    return None


def test_stopping_criterion_truncates_the_fixed_trajectory(tmp_path, tiny_base):
    """A run whose criterion never holds trains to the cap (reason step_cap) and records every evaluation; the
    criterion at a target taken from that record stops where the rule applied by hand to the record says (reason
    criterion), with the weights of a run capped at that very step: the criterion only decides where the run ends."""
    import dataclasses

    from looptrace.models.train import StopConfig

    # (a task and learning rate under which the tiny model learns something within 80 steps)
    base_cfg = tiny_train_config(steps=40, checkpoint_fractions=(), batch_size=32, lr=0.01, min_lr=0.001)
    never = dataclasses.replace(base_cfg, stop=StopConfig(target=1.0, patience=99, every=5, cycles=2))
    long = train_model(tiny_base, never, "mano", "uniform", tmp_path / "long", progress=False)
    assert long["steps"] == 80 and long["stop"]["reason"] == "step_cap"
    assert [h["step"] for h in long["history"]] == list(range(5, 81, 5))
    # its last evaluation ties its best: nothing to restore (the cap's restore: the test below)
    assert long["stop"]["restored_step"] is None
    assert long["history"][-1]["acc_per_loop"] == long["val"]["acc_per_loop"]
    # the target the record reaches twice in a row latest before the cap (here past the schedule's 40 steps)
    accs = sorted({h["acc_per_loop"][-1] for h in long["history"]})
    cases = [(t, _first_stop(long["history"], t, 2, 5)) for t in accs]
    target, at = max(((t, s) for t, s in cases if s is not None and s < 80), key=lambda c: c[1])
    crit = dataclasses.replace(base_cfg, stop=StopConfig(target=target, patience=2, every=5, cycles=2))
    got = train_model(tiny_base, crit, "mano", "uniform", tmp_path / "crit", progress=False)
    assert got["steps"] == at and got["stop"]["reason"] == "criterion"
    assert got["stop"]["first_step_at_target"] == next(h["step"] for h in long["history"]
                                                       if h["acc_per_loop"][-1] >= target)
    assert got["history"] == [h for h in long["history"] if h["step"] <= at]
    # the weights at step `at` of a run without the criterion: its kept checkpoint there (before the schedule's
    # end), or a run capped there (after it)
    if at < 40:
        ref_cfg = dataclasses.replace(base_cfg, checkpoint_fractions=(at / 40,))
        train_model(tiny_base, ref_cfg, "mano", "uniform", tmp_path / "ref", progress=False)
        ref_path = tmp_path / "ref" / "checkpoints" / f"step_{at:06d}.pt"
    else:
        capped = dataclasses.replace(never, stop=StopConfig(target=1.0, patience=99, every=5, hold=(at - 40) / 40, cycles=1))
        assert train_model(tiny_base, capped, "mano", "uniform", tmp_path / "ref", progress=False)["steps"] == at
        ref_path = tmp_path / "ref" / "model.pt"
    a, _ = load_checkpoint(tmp_path / "crit" / "model.pt")
    b, ck = load_checkpoint(ref_path)
    assert ck["step"] == at
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), n
    # without a target: exactly `steps`, no evaluation but the final one
    fixed = train_model(tiny_base, base_cfg, "mano", "uniform", tmp_path / "fixed", progress=False)
    assert fixed["steps"] == 40 and fixed["stop"] == {"reason": "budget", "steps": 40, "schedule_steps": 40,
                                                      "cap": 40, "target": None}
    assert [h["step"] for h in fixed["history"]] == [40]
    # past `steps` the learning rate stays at min_lr
    assert lr_at(60, dataclasses.replace(base_cfg, steps=40)) == base_cfg.min_lr


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


def test_step_cap_keeps_the_best_evaluated_weights(tmp_path, tiny_base):
    """A run that reaches the cap below its best evaluation ends with the weights of that evaluation (the earliest
    step of the highest full-depth val accuracy): the same bytes as a run stopped there by a target only that
    evaluation reaches, and its recorded val accuracy is that evaluation's."""
    import dataclasses

    from looptrace.models.train import StopConfig

    # a learning rate at which the tiny model peaks early and then falls back (measured: best at step 20 of 80)
    base_cfg = tiny_train_config(steps=40, checkpoint_fractions=(), batch_size=32, lr=0.05, min_lr=0.005)
    never = dataclasses.replace(base_cfg, stop=StopConfig(target=1.0, patience=99, every=5, cycles=2))
    long = train_model(tiny_base, never, "mano", "uniform", tmp_path / "long", progress=False)
    hist = long["history"]
    best = max(range(len(hist)), key=lambda i: (hist[i]["acc_per_loop"][-1], -i))
    assert long["stop"]["reason"] == "step_cap" and long["steps"] == 80
    assert hist[best]["acc_per_loop"][-1] > hist[-1]["acc_per_loop"][-1]  # this run ends below its best
    assert long["stop"]["restored_step"] == hist[best]["step"]
    assert long["val"]["acc_per_loop"] == hist[best]["acc_per_loop"]
    stop_there = dataclasses.replace(base_cfg, stop=StopConfig(target=hist[best]["acc_per_loop"][-1], patience=1,
                                                               every=5, cycles=2))
    ref = train_model(tiny_base, stop_there, "mano", "uniform", tmp_path / "ref", progress=False)
    assert ref["steps"] == hist[best]["step"] and ref["stop"]["restored_step"] is None
    a, _ = load_checkpoint(tmp_path / "long" / "model.pt")
    b, _ = load_checkpoint(tmp_path / "ref" / "model.pt")
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), n


def test_killed_run_resumes_the_criterion_mid_streak(tmp_path, tiny_base, monkeypatch):
    """Killed one step before the criterion holds (the last resume state mid-streak), the re-run continues the streak
    and stops at the same step with the same bytes as an uninterrupted run."""
    import dataclasses

    import looptrace.models.train as train_mod
    from looptrace.models.train import StopConfig, staging_dir

    cfg = tiny_train_config(steps=40, checkpoint_fractions=(0.25,), batch_size=32, lr=0.01, min_lr=0.001,
                            stop=StopConfig(target=1.0, patience=99, every=5, cycles=2))
    long = train_model(tiny_base, cfg, "mano", "uniform", tmp_path / "long", progress=False)
    cases = [(t, _first_stop(long["history"], t, 2, 5)) for t in {h["acc_per_loop"][-1] for h in long["history"]}]
    target, at = max(((t, s) for t, s in cases if s is not None and s < 80), key=lambda c: c[1])
    cfg = dataclasses.replace(cfg, stop=StopConfig(target=target, patience=2, every=5, cycles=2))
    ref = train_model(tiny_base, cfg, "mano", "uniform", tmp_path / "ref", progress=False)
    assert ref["steps"] == at and ref["stop"]["reason"] == "criterion"
    monkeypatch.setattr(train_mod, "RESUME_EVERY_S", 0.0)  # a resume state after every step
    out = tmp_path / "m"
    _kill_at(monkeypatch, at - 1)  # killed in step at - 1: the last resume state is step at - 2's, one hit in
    with pytest.raises(_Killed):
        train_model(tiny_base, cfg, "mano", "uniform", out, progress=False)
    state = torch.load(staging_dir(out) / "resume.pt", weights_only=True)
    assert (state["step"], state["streak"]) == (at - 2, 1)
    monkeypatch.undo()
    monkeypatch.setattr(train_mod, "RESUME_EVERY_S", 0.0)
    calls = _kill_at(monkeypatch, 10**9)
    got = train_model(tiny_base, cfg, "mano", "uniform", out, progress=False)
    assert len(calls) == 2 and got["steps"] == at and got["history"] == ref["history"]
    assert file_sha256(out / "model.pt") == file_sha256(tmp_path / "ref" / "model.pt")
    assert _files(out) == _files(tmp_path / "ref")


@pytest.mark.slow
def test_killed_pool_keeps_finished_models_and_rerun_trains_the_rest(tmp_path, repo_root):
    """The train stage (every model of the matrix, a pool of 2) SIGKILLed — with its workers — once the short model
    is written while the long one trains: the short model's directory is whole (its manifest and fingerprint
    check), nothing half-written is visible, and the re-run keeps it as it is and trains only the long one, to
    the bytes of that model trained alone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from looptrace.config import load_base, load_section
    from looptrace.io.guard import CURRENT_STAGE
    from looptrace.models.train import TrainConfig, finished_run, plan_run

    params = tmp_path / "params.yaml"
    params.write_text(
        "base: {seed: 0, threads: 1}\n"
        "train:\n  tasks: [rp, rs]\n  regimes: [u]\n  seeds: [0]\n  workers: 2\n"
        "  steps: 30\n  steps_by_task: {rs: 1500}\n  stop: {target: null}\n  batch_size: 16\n  warmup: 2\n"
        "  val_sequences: 16\n  checkpoint_fractions: [0.5]\n"
        "  task_defs: {rp: {kind: running_parity, length: 6}, rs: {kind: running_sum, length: 6, modulus: 3}}\n"
        "  regime_defs: {u: {kind: uniform}}\n"
        "  model: {d_model: 16, n_head: 2, groups: [{n_layer: 1, loops: 3}]}\n")
    out = tmp_path / "train"
    argv = [sys.executable, str(repo_root / "stages" / "train.py"), "--params", str(params), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo_root / "pipeline"), str(repo_root)])}
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "rp-u-s0" / "model.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert not (out / "rs-u-s0").exists(), "the long model finished before the kill: the test saw no kill mid-pool"
    base, cfg = load_base([params]), load_section(TrainConfig, "train", [params])
    token = CURRENT_STAGE.set("train")
    try:
        short = finished_run(out / "rp-u-s0", plan_run(base, cfg, "rp", "u", 0).fingerprint)
    finally:
        CURRENT_STAGE.reset(token)
    assert short is not None and short["model"] == "rp-u-s0"
    kept = (out / "rp-u-s0" / "model.pt").stat().st_mtime_ns
    res = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "rp-u-s0: up to date (budget at step 30" in res.stdout and "rs-u-s0: budget at step 1500" in res.stdout
    assert (out / "rp-u-s0" / "model.pt").stat().st_mtime_ns == kept
    assert sorted(p.name for p in out.iterdir()) == ["rp-u-s0", "rs-u-s0"]  # no staging dir, no claims left
    alone = train_model(base, cfg, "rs", "u", tmp_path / "alone", progress=False, seed=0)
    assert alone["steps"] == 1500
    assert file_sha256(tmp_path / "alone" / "model.pt") == file_sha256(out / "rs-u-s0" / "model.pt")
