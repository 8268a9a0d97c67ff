"""Loop self-speculative decoding (looptrace.online.speculative) and its offline prediction
(looptrace.online.speculative_predict).

- Lossless: the emitted tokens and their log-probabilities equal full-depth greedy decoding bit for bit, on
  looptrace's model (chunked verification; every loop form, a coda, two looped groups, loop memory's per-position
  verification) at batch 1 and a batch whose rows accept different lengths, for every k < T and several d; on
  the Dory, Ouro, Huginn and retrofit stand-ins at batch 1 and 3 (Ouro and retrofit verify in a chunk, to float
  tolerance against per-position verification; Dory and Huginn position by position).
- The chunk after a cached prefix (the causal offset mask) gives every position the logits it has decoded alone.
- The blocks equal the ones simulated from the full forward's per-loop argmax along the decoded sequences
  (independent: the uncached forward, no decoder).
- The prediction on hand-built agreement patterns: windows, acceptance probabilities and the horizon recursion
  against hand-computed values and a Monte Carlo of the simulation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from looptrace.config import ConfigError
from looptrace.models.decode import DecodeUnsupported, LoopDecoder
from looptrace.models.decoders import decoder_for
from looptrace.models.looped import GroupConfig, LoopedTransformer, ModelConfig
from looptrace.online.generate import decode_tokens
from looptrace.online.speculative import (
    SpeculativeConfig,
    SpeculativeStage,
    continuation_agreement,
    decode_speculative,
    measure_costs,
)
from looptrace.online.speculative_predict import (
    SpecCosts,
    agreement_windows,
    batch_acceptance,
    horizon_expectations,
    predict_speculative,
    simulate_blocks,
)
from tests.test_generate import own_model, prompts_of
from tests.test_generate import standins as _standins_fixture

standins = _standins_fixture  # the Dory, Ouro, Huginn and retrofit stand-ins (a module-scoped fixture)

torch.set_num_threads(1)


def _model(kind: str) -> LoopedTransformer:
    if kind == "memory":
        torch.manual_seed(2)
        cfg = ModelConfig(vocab_size=7, block_size=24, d_model=16, n_head=2, n_coda=1,
                          groups=(GroupConfig(1, 4),), loop_memory=True)
        return LoopedTransformer(cfg).eval()
    if kind == "groups":
        return own_model(groups=(GroupConfig(1, 2), GroupConfig(2, 3)), vocab=7, seed=3)
    if kind in ("norm_add", "adapter"):
        torch.manual_seed(4)
        cfg = ModelConfig(vocab_size=7, block_size=24, d_model=16, n_head=2, n_prelude=1, n_coda=0,
                          groups=(GroupConfig(1, 5),), loop_form=kind)
        return LoopedTransformer(cfg).eval()
    return own_model(T=6, seed=5, vocab=7, d=16, coda=0 if kind == "plain" else 1)


@pytest.mark.parametrize("kind", ["plain", "coda", "groups", "norm_add", "adapter", "memory"])
def test_speculative_equals_full_depth_greedy_own_model(kind):
    m = _model(kind)
    T, N = m.n_loops, 12
    p = prompts_of(B=4, S=3, seed=5, hi=7)
    dec = decoder_for(m, "recompute")
    assert dec.chunk_verify == (kind != "memory")
    varied = False
    for B in (1, 4):
        ref = decode_tokens(dec, p[:B], N)
        for k in range(1, T):
            for d in (1, 3, 8):
                r = decode_speculative(dec, p[:B], N, k, d)
                assert np.array_equal(r.tokens, ref.tokens), (kind, B, k, d)
                assert np.array_equal(r.logprob, ref.logprob), (kind, B, k, d)
                assert r.emitted.sum() == N and (r.emitted <= r.draft + 1).all()
                assert (r.emitted == r.accepted.min(axis=1) + 1).all()
                varied |= bool((r.accepted.min(axis=1) != r.accepted.max(axis=1)).any())
    if kind == "plain":
        assert varied  # rows of the batch accepted different lengths in some block


def test_speculative_with_share_decoder_and_refusals():
    m = _model("plain")
    p = prompts_of(B=2, S=3, seed=5, hi=7)
    ref = decode_tokens(decoder_for(m, "recompute"), p, 8)
    assert np.array_equal(decode_speculative(decoder_for(m, "share"), p, 8, 2, 3).tokens, ref.tokens)
    dec = decoder_for(m, "recompute")
    with pytest.raises(ConfigError, match="1 ≤ k < T"):
        decode_speculative(dec, p, 4, 6, 2)
    with pytest.raises(ConfigError, match="d ≥ 1"):
        decode_speculative(dec, p, 4, 2, 0)
    with pytest.raises(ConfigError, match="generate.speculative.k"):
        SpeculativeConfig(k=())


def test_chunk_after_a_cached_prefix_equals_each_position_decoded_alone():
    """The verification chunk (loops k+1..T of q positions over a cached prefix, causal offset mask) gives each
    position the logits of the generic, one-position-at-a-time full-depth pass, bit for bit."""
    m = _model("coda")
    p = prompts_of(B=3, S=4, seed=1, hi=7)
    x = torch.randint(0, 7, (3, 5), generator=torch.Generator().manual_seed(3))
    dec = decoder_for(m, "recompute")
    out = {}
    for chunk in (True, False):
        with torch.inference_mode():
            dec.reset(p, 4 + 5)
            dec.prefill(p)
            k, injs, hs = 2, [], []
            for j in range(5):
                inj, h = dec.start(x[:, j])
                for t in range(k):
                    h = dec.step(t, h, inj, None)
                injs.append(inj)
                hs.append(h)
                dec.advance()
            dec.pos = 4
            if chunk:
                out[chunk] = dec.verify(x, torch.cat(injs, 1), torch.cat(hs, 1), k)
            else:
                out[chunk] = LoopDecoder.verify(dec, x, None, None, k)  # the generic, per-position form
            assert dec.pos == 9
    assert torch.equal(out[True], out[False])
    with torch.inference_mode():  # and the uncached forward agrees (to float tolerance)
        z = m(torch.cat([p, x], 1)).logits[:, 4:, -1]
    torch.testing.assert_close(out[True], z, rtol=0, atol=1e-5)


def test_blocks_equal_the_simulation_on_the_forward_argmax():
    """Acceptance lengths known independently: the uncached forward of prompt + full-depth continuation gives
    argmax at every loop; a_k along the continuation determines every block (no coda: a draft's readout is the
    forward's loop-k readout)."""
    m = _model("plain")
    p = prompts_of(B=4, S=3, seed=5, hi=7)
    N, T = 12, m.n_loops
    dec = decoder_for(m, "recompute")
    ref = decode_tokens(dec, p, N)
    with torch.inference_mode():
        am = m(torch.cat([p, torch.from_numpy(ref.tokens)], 1)).logits.argmax(-1).numpy()  # [B, S, T]
    seen = set()
    cont = continuation_agreement(dec, p, N)  # the decoder's own probe of the continuation: the same agreements
    assert np.array_equal(cont, am[:, 2:2 + N, :T - 1] == am[:, 2:2 + N, T - 1:])
    for B in (1, 4):
        for k in range(1, T):
            agree = am[:B, 2:2 + N, k - 1] == am[:B, 2:2 + N, T - 1]
            for d in (1, 2, 5):
                r = decode_speculative(dec, p[:B], N, k, d)
                draft, emitted = simulate_blocks(agree, d)
                assert np.array_equal(r.draft, draft) and np.array_equal(r.emitted, emitted), (B, k, d)
                seen |= set(emitted.tolist())
    assert len(seen) >= 3  # blocks of several lengths: a real test


@pytest.mark.parametrize("kind", ["dory", "ouro", "huginn", "retrofit"])
def test_speculative_equals_full_depth_greedy_standins(standins, kind):
    """Ouro and retrofit verify in a chunk (the model's own layers, an explicit causal mask), Dory (sliding-window
    layers) and Huginn (its attention takes no mask) position by position. The chunk's logits equal the per-position
    ones to float tolerance (the adapters run their published kernels: bit equality only where the BLAS is
    row-invariant), and the tokens equal full depth's."""
    ad = standins[kind]
    dec = decoder_for(ad, "recompute")
    assert dec.chunk_verify == (kind in ("ouro", "retrofit"))
    p = prompts_of(B=3, S=4, lo=3, hi=250)
    for B in (1, 3):
        ref = decode_tokens(dec, p[:B], 6)
        for k in range(1, ad.info.n_loops):
            r = decode_speculative(dec, p[:B], 6, k, 3)
            assert np.array_equal(r.tokens, ref.tokens), (kind, B, k)
            np.testing.assert_allclose(r.logprob, ref.logprob, rtol=0, atol=1e-4)
    if dec.chunk_verify:  # the chunk against the generic per-position verification of the same drafts
        x = torch.from_numpy(ref.tokens[:, :4])
        out = []
        for chunk in (True, False):
            with torch.inference_mode():
                dec.reset(p[:B], 4 + 4)
                dec.prefill(p[:B])
                injs, hs = [], []
                for j in range(4):
                    inj, h = dec.start(x[:, j])
                    h = dec.step(0, h, inj, None)
                    injs.append(inj)
                    hs.append(h)
                    dec.advance()
                dec.pos = 4
                cat = torch.cat(injs, 1) if injs[0] is not None else None
                out.append(dec.verify(x, cat, torch.cat(hs, 1), 1) if chunk else
                           LoopDecoder.verify(dec, x, None, None, 1))
        torch.testing.assert_close(out[0], out[1], rtol=0, atol=1e-5)
    if kind in ("ouro", "huginn"):
        with pytest.raises(DecodeUnsupported, match="native"):
            decode_speculative(decoder_for(ad, "native"), p, 4, 1, 2)


def test_measure_costs_shapes():
    m = _model("plain")
    c = measure_costs(decoder_for(m, "recompute"), prompts_of(B=2, S=3, hi=7), 2, 3, 6, repeats=1)
    assert len(c.draft) == len(c.verify) == len(c.accept) == 4 and c.chunk and min(*c.verify, *c.accept, c.full) > 0
    assert c.draft[3] > c.draft[0] > 0 and c.block(3) == pytest.approx(c.draft[3] + c.verify[3] + c.accept[3])
    # a draft length beyond the horizon: blocks up to N − 1 drafts only (the decode never makes a longer one)
    assert len(measure_costs(decoder_for(m, "recompute"), prompts_of(B=1, S=3, hi=7), 2, 9, 3, repeats=1).verify) == 3


# ---------------------------------------------------------------------------------------------- prediction

def _store(rows: list[list[int]], T: int = 3, k: int = 1, positions=None):
    """A store whose token (s, i) agrees at loop k iff rows[s][i] (argmax_T = 0; argmax_k = 0 or 1)."""
    am, seq, pos = [], [], []
    for s, r in enumerate(rows):
        for i, a in enumerate(r):
            v = np.zeros(T, np.int64)
            v[k - 1] = 0 if a else 1
            am.append(v)
            seq.append(s)
            pos.append(i if positions is None else positions[s][i])
    return {"argmax": np.stack(am), "sequence": np.asarray(seq), "position": np.asarray(pos)}


def test_agreement_windows_hand_built():
    st = _store([[1, 1, 0, 1], [1, 1, 1]], positions=[[0, 1, 2, 3], [5, 6, 8]])  # seq 1 lacks position 7
    hits, fits = agreement_windows(st["argmax"], st["sequence"], st["position"], 1, 3)
    #            seq 0: i = 0  1  2  3       seq 1: pos 5  6  8
    want_f = np.array([[1, 1, 1, 1, 1, 1, 1],
                       [1, 1, 1, 0, 1, 0, 0],
                       [1, 1, 0, 0, 0, 0, 0]], bool)
    want_h = np.array([[1, 1, 0, 1, 1, 1, 1],
                       [1, 0, 0, 0, 1, 0, 0],
                       [0, 0, 0, 0, 0, 0, 0]], bool)
    assert np.array_equal(fits, want_f) and np.array_equal(hits, want_h)
    # shuffled token order: the same per-token answers
    perm = np.array([6, 2, 0, 5, 3, 1, 4])
    h2, f2 = agreement_windows(st["argmax"][perm], st["sequence"][perm], st["position"][perm], 1, 3)
    assert np.array_equal(h2, want_h[:, perm]) and np.array_equal(f2, want_f[:, perm])


def test_horizon_recursion_hand_computed_and_closed_forms():
    unit = SpecCosts(draft=(0.0, 0.0), verify=(1.0, 1.0), accept=(0.0, 0.0))  # every block costs 1
    # d = 1, N = 3, q_1 = 1/2: E_b(1) = 1, E_b(2) = 1 + E_b(1)/2 = 1.5, E_b(3) = 1 + (E_b(2) + E_b(1))/2 = 2.25
    Eb, Ec = horizon_expectations(np.array([0.5]), 3, unit.block)
    assert Eb == pytest.approx(2.25) and Ec == pytest.approx(2.25)
    # all drafts accepted: ceil(N / (d + 1)) blocks; none: N blocks
    for N, d in [(8, 3), (9, 3), (1, 4), (7, 1)]:
        costs = SpecCosts(draft=tuple(1.5 * q for q in range(d + 1)), verify=tuple(10.0 + q for q in range(d + 1)),
                          accept=(0.1,) * (d + 1))
        Eb, Ec = horizon_expectations(np.ones(d), N, costs.block)
        assert Eb == pytest.approx(-(-N // (d + 1)))
        Eb0, Ec0 = horizon_expectations(np.zeros(d), N, costs.block)
        assert Eb0 == pytest.approx(N)
        assert Ec0 == pytest.approx(sum(costs.block(min(d, r - 1)) for r in range(1, N + 1)))
    assert SpecCosts((1.0, 2.0, 3.0), (3.0, 4.0, 5.0), (0.1, 0.2, 0.3)).block(2) == pytest.approx(3 + 5 + 0.3)
    # batch: Q_j = (running min of q)^B
    assert np.allclose(batch_acceptance(np.array([0.9, 0.95, 0.5]), 2), [0.81, 0.81, 0.25])


def test_horizon_recursion_equals_a_monte_carlo_of_the_decoder():
    """i.i.d. agreements with P = α: the recursion's expected blocks equals the mean over simulated decodes, and
    q_j estimated from those sequences is α^j."""
    rng = np.random.default_rng(0)
    alpha, N, d, B = 0.7, 10, 3, 2
    agree = rng.random((20000, B, N)) < alpha
    blocks = np.mean([simulate_blocks(a, d)[0].size for a in agree[:4000]])
    Eb, _ = horizon_expectations(batch_acceptance(alpha ** np.arange(1, d + 1), B), N, lambda dd: 1.0)
    assert blocks == pytest.approx(float(Eb), rel=0.02)
    st = {"argmax": np.stack([np.where(agree[:, 0].ravel(), 0, 1), np.zeros(agree[:, 0].size, np.int64)], 1),
          "sequence": np.repeat(np.arange(20000), N), "position": np.tile(np.arange(N), 20000)}
    hits, fits = agreement_windows(st["argmax"], st["sequence"], st["position"], 1, d)
    assert np.allclose(hits.sum(1) / fits.sum(1), alpha ** np.arange(1, d + 1), atol=0.01)


def test_predict_speculative_hand_store():
    """Two sequences, every position agrees but one: q_1 = 7/8, q_2 = 4/6 (of the 6 windows of 2, the two holding
    the disagreement fail), the
    horizon recursion at N = 2, d = 1, batch 1: E_b = 1 + P(m = 0) = 1 + 1/8; speedup = N·c_full / E_c."""
    st = _store([[1, 1, 0, 1], [1, 1, 1, 1]])
    costs = SpecCosts(draft=(1.0, 2.5, 4.0), verify=(4.0, 5.0, 6.0), accept=(0.25, 0.25, 0.25), full=3.0)
    out = predict_speculative(st, 1, 2, 1, 2, costs)
    assert out["q1"] == pytest.approx(7 / 8) and out["agreement"] == pytest.approx(7 / 8)
    assert out["accept_steady"] == pytest.approx(1 + 7 / 8 + 4 / 6)
    # N = 2: first block d' = 1 (cost 2.5 + 5 + 0.25 = 7.75); with P 1/8 one more block of d' = 0 (1 + 4 + .25)
    Eb = 1 + 1 / 8
    Ec = 7.75 + (1 / 8) * 5.25
    assert out["tokens_per_block"] == pytest.approx(2 / Eb)
    assert out["speedup"] == pytest.approx(2 * 3.0 / Ec)
    assert np.isnan(out["speedup_lo"])
    from looptrace.intervals import Resampler

    rs = Resampler(st["sequence"], 200, seed=1)
    out2 = predict_speculative(st, 1, 2, 1, 2, costs, rs)
    assert out2["speedup_lo"] <= out2["speedup"] <= out2["speedup_hi"]
    assert out2["accept_steady_lo"] <= out2["accept_steady"] <= out2["accept_steady_hi"]


def test_generate_stage_speculative_section(tmp_path):
    """generate_models with generate.speculative on a train -> dump -> readouts pipeline: one row per k × d × batch
    size (a k ≥ T skipped with its reason), exact tokens, the prediction from the store's argmax (the same figures
    as predict_speculative on the store's arrays), intervals around the estimates; speculative.parquet written."""
    import polars as pl

    from looptrace.io.store.reader import open_store
    from looptrace.online.generate import GenerateConfig, generate_models, write_generate
    from tests.test_latency import _tiny_pipeline

    name, _, _ = _tiny_pipeline(tmp_path)
    roots = {k: tmp_path / k for k in ("train", "dump", "readouts", "gates")}
    cfg = GenerateConfig(rules=("top1",), policies=("recompute",), batch_sizes=(1, 3), prompts=3, prompt_len=3,
                         new_tokens=5, repeats=1, speculative=SpeculativeConfig(k=(1, 3, 4), d=(2,), cost_repeats=1))
    assert cfg.speculative is not None
    stage = SpeculativeStage(cfg.speculative, cfg.batch_sizes, cfg.new_tokens, cfg.repeats, 200, 0.95)
    df, metrics = generate_models([name], cfg, roots["dump"], roots["readouts"], roots["gates"],
                                  train_root=roots["train"], progress=False, after_model=stage)
    spec, metrics["speculative"] = stage.frame(), stage.metrics()
    assert spec.height == 2 * 2  # k (1, 3) × batch (1, 3); k = 4 = T skipped
    assert "T = 4" in metrics["models"][name]["skipped"]["speculative:k=4"]
    assert spec["exact"].all() and metrics["speculative"]["all_exact"]
    st = open_store(roots["dump"] / name / "test.zarr")
    arrays = {a: st.read(a) for a in ("argmax", "sequence", "position")}
    for r in spec.iter_rows(named=True):
        want = predict_speculative(arrays, r["k"], r["d"], r["batch_size"], 5,
                                   SpecCosts((1.0,) * 3, (1.0,) * 3, (1.0,) * 3, full=1.0))
        assert r["predicted_tokens_per_block"] == pytest.approx(want["tokens_per_block"], rel=1e-12)
        assert r["store_agreement"] == pytest.approx(want["agreement"], rel=1e-12)
        for f in ("predicted_tokens_per_block", "predicted_speedup", "predicted_accept_steady"):
            assert r[f + "_lo"] <= r[f] <= r[f + "_hi"], f
        assert 1.0 <= r["realised_tokens_per_block"] <= 3.0 and r["verify"] == "chunk"
        # no coda: the blocks simulated on the continuations' own agreement are the realised ones
        assert r["continuation_tokens_per_block"] == pytest.approx(r["realised_tokens_per_block"], rel=1e-12)
        assert r["cost_model_ratio"] == pytest.approx(r["realised_speedup"] / r["continuation_speedup"], rel=1e-12)
        assert r["speedup_ratio"] == pytest.approx(r["realised_speedup"] / r["predicted_speedup"], rel=1e-12)
    write_generate(tmp_path / "generate", df, metrics, spec)
    assert pl.read_parquet(tmp_path / "generate" / "speculative.parquet").shape == spec.shape
