"""The signal registry (looptrace.signals.names) is the one vocabulary: the store schema, token_loop.parquet's
columns and dtypes, the exit-rule vocabulary and built-ins, the gate features and the signal functions all agree
with it; no other module of the library spells out a list of signal names; the firing conditions and the halting
forms (numpy and torch) agree with themselves."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from looptrace.signals import names
from looptrace.signals.names import REGISTRY, SIGNALS, select

REPO = Path(__file__).resolve().parents[1]
LIB = REPO / "pipeline" / "looptrace"


def test_registry_entries_are_consistent():
    assert len(SIGNALS) == len(REGISTRY)
    spec = (REPO / "docs" / "SPEC.md").read_text()
    sections = {f"§{m}" for m in re.findall(r"^## (\d+)\.", spec, re.M)}
    for s in REGISTRY:
        assert s.source in names.SOURCES, s
        assert s.first_loop >= 1, s
        assert s.spec in sections, s
        assert s.online == (not s.offline_why), s  # an offline-only signal says why
        assert not (s.feature and s.no_feature_why), s
        assert s.alias_of is None or (s.alias_of in SIGNALS and SIGNALS[s.alias_of].alias_of is None), s
        assert s.name in spec, f"SPEC.md does not mention signal {s.name!r}"
    # the label and a later loop's readout are never features nor online
    for s in REGISTRY:
        if not s.online:
            assert not s.feature, s


def test_store_schema_agrees():
    from looptrace.io.store import schema as store
    from looptrace.io.store.location import memory_store
    from tests.builders import random_store_arrays, write_arrays

    assert store.STAT_NAMES == select("logits", stored=True)
    stored = select(stored=True)
    # every per-(token, loop) array of the store is a registered stored signal, but the opt-in loop-map statistics
    # (dump.contraction, SPEC §2b) that only looptrace.diagnose.loopmap reads (ftle, ftle_share); ρ_t
    # (``contraction``) is a registered opt-in signal (the certified_fixed_point rule reads it)
    per_loop = {k for k, d in store.DIMS.items() if d == ("token", "loop")}
    assert per_loop - (set(store.CONTRACTION_NAMES) - set(names.OPT_IN)) == set(stored)
    assert set(names.OPT_IN) <= set(store.CONTRACTION_NAMES)
    for n in stored:
        assert store.DTYPES[n] == SIGNALS[n].dtype, n
    assert set(store.REQUIRED) >= set(select("logits", stored=True))
    # a written store holds them with those dtypes
    st = write_arrays(memory_store(), random_store_arrays(gate=True), attrs={"vocab_size": 5})
    for n in (n for n in stored if n not in names.OPT_IN):
        assert str(st.read(n).dtype) == SIGNALS[n].dtype, n


def test_token_loop_columns_agree():
    import pyarrow as pa

    from looptrace import geometry
    from looptrace.io.store.location import memory_store
    from tests.builders import random_signal_arrays, write_arrays

    cols = geometry.TOKEN_LOOP_COLUMNS
    signal_cols = [c for c in cols if c in SIGNALS]
    assert set(signal_cols) == set(SIGNALS) - set(names.OPT_IN), "every registered signal is a token_loop.parquet column"
    assert not set(names.OPT_IN) & set(cols), "opt-in signals are columns only when the store has them"
    assert geometry.OPT_IN_COLUMNS == tuple(names.OPT_IN)
    # each source's columns in registry order (integer columns first)
    for src in ("logits", "states"):
        assert [c for c in signal_cols if SIGNALS[c].source == src] == [
            n for n in sorted(select(src), key=lambda n: SIGNALS[n].dtype == "float32")], src
    assert geometry.STORE_STATS == select("logits", stored=True, dtype="float32")
    assert geometry.CONVERGENCE_SIGNALS == tuple(s.name for s in REGISTRY if s.convergence)
    # the Arrow schema and a real block's table: ints widened to int64, bool, float32
    want = {"int32": pa.int64(), "int64": pa.int64(), "bool": pa.bool_(), "float32": pa.float32()}
    rng = np.random.default_rng(0)
    st = write_arrays(memory_store(), random_signal_arrays(rng, N=12, T=5))
    table = geometry.token_loop_table(next(geometry.iter_blocks(st)), "val", np.zeros(5, np.int64))
    assert tuple(table.column_names) == cols
    for n in SIGNALS:
        schema = geometry.token_loop_schema(names.OPT_IN) if n in names.OPT_IN else geometry._TOKEN_LOOP_SCHEMA
        assert schema.field(n).type == want[SIGNALS[n].dtype], n
        if n in names.OPT_IN:
            continue
        assert table.schema.field(n).type == want[SIGNALS[n].dtype], n
    for alias, of in names.ALIASES.items():
        assert table[alias].equals(table[of])


def test_rule_vocabulary_agrees():
    from looptrace.rules import base as registry
    from looptrace.rules.builtin import BUILTIN_RULES, LOOP_COLUMNS, OURO_Q_EXIT_RULES
    from looptrace.rules.registry import RULES  # the registered rules (calm, certified_fixed_point, ...)

    assert registry.ONLINE_SIGNALS == select(online=True)
    assert set(registry.SIGNALS) == set(SIGNALS)
    assert registry.OFFLINE_ONLY_SIGNALS == {s.name: s.offline_why for s in REGISTRY if not s.online}
    for r in (*BUILTIN_RULES.values(), *OURO_Q_EXIT_RULES.values(), *RULES.values()):
        for s in r.signals:
            assert s in SIGNALS, (r.name, s)
            assert SIGNALS[s].online or r.kind == "oracle" or (s in names.OFFLINE_CAUSAL and r.online is None), (
                r.name, s)
            # a rule never reads a loop before its signal is defined (t − 1 too for two-hit rules)
            assert r.min_loop - int(r.two_hit) >= SIGNALS[s].first_loop, (r.name, s)
    assert set(LOOP_COLUMNS) <= set(SIGNALS)


def test_gate_features_agree():
    from looptrace.gates import config
    from looptrace.gates.features import block_stats
    from looptrace.io.store.location import memory_store
    from tests.builders import random_signal_arrays, write_arrays

    assert config.STORE_FEATURES == select(stored=True, feature=True)
    assert config.GEOMETRY_FEATURES == select("states", feature=True)
    assert set(config.FEATURE_STATS) == {s.name for s in REGISTRY if s.feature}
    assert set(config.FORBIDDEN_STATS) == {s.name for s in REGISTRY if s.no_feature_why}
    assert config.SIGNED_STATS == tuple(s.name for s in REGISTRY if s.signed)
    for n in config.GatesConfig().stats:
        assert SIGNALS[n].feature
    # every feature can be computed from a store (stored ones read, state ones from step_metrics)
    rng = np.random.default_rng(1)
    st = write_arrays(memory_store(), random_signal_arrays(rng, N=10, T=5))
    got = block_stats(st, slice(0, 10), config.FEATURE_STATS)
    assert got.shape == (10, 5, len(config.FEATURE_STATS))
    j = {n: i for i, n in enumerate(config.FEATURE_STATS)}
    for alias, of in names.ALIASES.items():
        assert np.array_equal(got[..., j[alias]], got[..., j[of]], equal_nan=True)


def test_first_loop_is_where_the_functions_define_the_signal():
    torch = pytest.importorskip("torch")
    from looptrace.signals.logits import STAT_NAMES, logit_stats
    from looptrace.signals.steps import GEOMETRY_METRICS, step_metrics

    assert STAT_NAMES == names.LOGIT_SIGNALS and GEOMETRY_METRICS == names.STEP_SIGNALS
    rng = np.random.default_rng(2)
    N, T = 30, 5
    out = {**logit_stats(torch.as_tensor(rng.normal(size=(N, T, 7)).astype(np.float32)), torch.as_tensor(
        rng.integers(0, 7, N))), **step_metrics(rng.normal(size=(N, T, 6)), rng.normal(size=(N, 6)))}
    names.add_aliases(out)
    for n, v in out.items():
        f = SIGNALS[n].first_loop
        if f > 1:
            assert np.isnan(v[:, :f - 1]).all(), n
        assert np.isfinite(v[:, f - 1:]).all(), n


def test_live_signals_know_every_online_signal():
    pytest.importorskip("torch")
    from looptrace.online.signals import LiveSignals

    LiveSignals([n for n in select(online=True)])  # raises on a signal it cannot compute


def test_no_module_spells_out_the_signal_vocabulary():
    """Only the registry lists signal names: a tuple / list / set / dict of ≥ 3 registered names elsewhere in the
    library is a second vocabulary (allowed: a signal's own module naming what its evaluator needs, params defaults
    that pick signals, the columns a stage chooses to read or summarise, and dicts built column by column)."""
    own = {"signals/names.py", "signals/logits.py", "signals/steps.py"}
    chosen = {"spearman_signals", "stats", "eps", "DYNAMICS_METRICS", "LOOP_COLUMNS", "PREDICTORS"}
    found = []
    for f in sorted(LIB.rglob("*.py")):
        rel = f.relative_to(LIB).as_posix()
        if rel in own:
            continue
        tree = ast.parse(f.read_text())
        skip: set[int] = set()
        for node in ast.walk(tree):
            target = (node.target if isinstance(node, ast.AnnAssign) else
                      node.targets[0] if isinstance(node, ast.Assign) else None)
            if isinstance(target, ast.Name) and target.id in chosen:
                skip.update(id(n) for n in ast.walk(node))
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                elts = node.elts
            elif isinstance(node, ast.Dict) and all(isinstance(v, ast.Constant) for v in node.values):
                elts = [k for k in node.keys if k is not None]  # a name -> constant table (not columns built)
            else:
                continue
            strs = [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if sum(s in SIGNALS for s in strs) >= 3:
                found.append(f"{rel}:{node.lineno} {strs[:4]}")
    assert not found, f"literal signal lists outside looptrace/signals/names.py: {found}"


def test_registry_module_loads_no_torch():
    code = ("import sys; import looptrace.signals.names, looptrace.signals.firing, looptrace.signals.halting; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------- the rules beside them


def test_two_hit_vectorised_equals_streaming_numpy_and_torch():
    torch = pytest.importorskip("torch")
    from looptrace.signals.firing import two_hit, two_hit_step

    hit = np.random.default_rng(3).random((4, 9, 6)) < 0.6
    want = hit & np.concatenate([np.zeros((4, 9, 1), bool), hit[..., :-1]], axis=-1)
    assert np.array_equal(two_hit(hit), want)
    for xp in (np.asarray, torch.as_tensor):
        prev, cols = None, []
        for t in range(hit.shape[-1]):
            h = xp(hit[..., t])
            cols.append(np.asarray(two_hit_step(h, prev)))
            prev = h
        assert np.array_equal(np.stack(cols, -1), want)


def test_argmax_stable_counter_vectorised_streaming_and_compacted():
    from looptrace.signals.firing import ArgmaxStableCount, argmax_stable_count

    a = np.random.default_rng(4).integers(0, 2, (50, 8))
    ref = np.zeros(a.shape, np.int64)  # Huginn: c_1 = 0, c_t = c_{t−1} + 1 if argmax_t == argmax_{t−1} else 0
    for t in range(1, a.shape[1]):
        ref[:, t] = np.where(a[:, t] == a[:, t - 1], ref[:, t - 1] + 1, 0)
    got = argmax_stable_count(a)
    assert got.dtype == np.int64 and np.array_equal(got, ref)
    acc, rows = ArgmaxStableCount(), np.arange(0, 50, 3)
    b = a.reshape(50, 1, 8)
    for t in range(8):
        if t == 4:
            acc.compact(rows, None)
        c = acc.update(b[:, :, t] if t < 4 else b[rows, :, t])
        assert np.array_equal(c[:, 0], ref[:, t] if t < 4 else ref[rows, t])


def test_halting_numpy_and_torch_agree():
    torch = pytest.importorskip("torch")
    from looptrace.signals.halting import HaltingCDF, halting_cdf
    from looptrace.signals.halting_torch import halting_distribution, halting_lambda

    g = np.random.default_rng(5).normal(scale=3.0, size=(20, 7))
    cdf = halting_cdf(g)
    q = halting_distribution(torch.as_tensor(g)).numpy()  # float64 in, float64 out
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.cumsum(q, -1)[:, :-1], cdf[:, :-1], rtol=0, atol=1e-12)  # CDF_t = Σ_{j≤t} q_j
    lam = halting_lambda(torch.as_tensor(g)).numpy()
    np.testing.assert_allclose(lam[:, 0], cdf[:, 0], rtol=0, atol=1e-15)  # CDF_1 = λ_1
    np.testing.assert_allclose(1 - lam, np.exp(-np.logaddexp(0.0, g)), rtol=1e-12)
    acc = HaltingCDF()
    assert np.array_equal(np.stack([acc.update(g[:, t]) for t in range(7)], -1), cdf)
