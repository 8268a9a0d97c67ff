"""Loop self-speculative decoding: lossless speed from the loops (SPEC §8 "Loop self-speculative decoding").

A looped model is its own draft model: k < T loops of the same weights propose the next tokens, one full-depth
pass checks them. One **block** of :func:`decode_speculative`, at position p with the current token x_0:

1. **draft**: for j = 0..d'−1, embed x_j at position p+j, run loops 1..k, read out after loop k, x_{j+1} = its
   argmax (fed back on the device: no host round trip). d' = min(d, tokens still to emit − 1), so a block never
   emits past the horizon. Where the decoder verifies in a chunk (:attr:`~looptrace.models.decode.LoopDecoder.
   chunk_verify`: looptrace's own model) position p+d' runs its loops 1..k too (no readout): its state is the
   verification's starting point.
2. **verify**: one pass over the q = d'+1 positions p..p+d' (tokens x_0..x_{d'}) at full depth
   (:meth:`~looptrace.models.decode.LoopDecoder.verify`) -> the full-depth greedy tokens y_1..y_q. A chunk runs
   only loops k+1..T: a position's loop t attends to the loop-t keys/values of the positions up to it, so the
   draft's loops 1..k (and prelude) of x_0..x_{d'} are exactly full depth's and the chunk continues from them;
   its attention sees the cached prefix through a causal offset mask, and the batch-invariant kernels
   (SPEC §8 "Batch-invariant inference") give every position of the chunk the numbers it has when decoded alone.
   The generic form re-runs each position through the decode path (exact on every kind; no saving).
3. **accept**: per row r, m_r = the number of leading drafts equal to the full-depth token (x_j = y_j for
   j = 1..m_r). The batch's rows share one cache position, so the block emits a = min_r m_r + 1 tokens, y_1..y_a,
   for every row: y_j is full depth's token whenever every earlier token fed is (true for j ≤ a), so the emitted
   tokens are full-depth greedy decoding's, row by row, at any batch size. Rows that accepted more redo those
   tokens in the next block (per-row acceptance is recorded).
4. **roll back**: the cache position moves to p+a (the slots of the rejected positions are rewritten before
   anything reads them: a call writes its positions before attending), and y_a is the next block's x_0.

KV policy for the loops the draft skips: none is needed — a draft at loop t ≤ k only reads loops ≤ k, and the
verification writes loops k+1..T (and the coda at T) of every drafted position before a later block reads them
(``verify-overwrite``). The decoder must keep its cache in looptrace's :class:`~looptrace.models.kv.LoopKVCache`
(any policy but ``native``: a model's own cache cannot be rewound).

:func:`measure_costs` times the pieces of a block (the cost model of the prediction,
:mod:`looptrace.online.speculative_predict`); :func:`speculative_model` is the ``generate`` stage's
``generate.speculative`` section: realised against predicted acceptance and speedup.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from looptrace.config import ConfigError
from looptrace.models.decode import DecodeUnsupported, LoopDecoder
from looptrace.online.engine import OnlineRule
from looptrace.online.speculative_predict import (
    SpecCosts,
    SpeculativeConfig,
    predict_speculative,
    simulate_blocks,
)

# ----------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------


@dataclass
class SpecRun:
    """One speculative decoding run over a batch of prompts.

    Attributes:
        tokens: [batch, new] int64, the emitted tokens (full-depth greedy decoding's).
        logprob: [batch, new] float64, each emitted token's log-probability under the full-depth readout.
        draft: [blocks] int64, the block's draft length d'.
        emitted: [blocks] int64, tokens the block emitted (a = min over rows of accepted + 1).
        accepted: [blocks, batch] int64, each row's leading drafts equal to full depth's (m_r ≤ d').
        row_loops: loop steps computed over rows and positions (drafts and verifications).
        seconds: wall time of the decoding (prefill excluded).
        prefill_seconds: wall time of the prefill.
    """

    tokens: np.ndarray
    logprob: np.ndarray
    draft: np.ndarray
    emitted: np.ndarray
    accepted: np.ndarray
    row_loops: int
    seconds: float
    prefill_seconds: float

    @property
    def blocks(self) -> int:
        """Verification passes (blocks)."""
        return int(self.draft.size)


def check_speculative(dec: LoopDecoder, k: int, d: int) -> None:
    """Refuse a draft depth, a draft length or a decoder speculative decoding cannot run (one line each)."""
    if not 1 <= k < dec.n_loops:
        raise ConfigError(f"speculative decoding drafts with k loops, 1 ≤ k < T = {dec.n_loops}; got k = {k}")
    if d < 1:
        raise ConfigError(f"speculative decoding drafts d ≥ 1 tokens per block; got d = {d}")
    if dec.policy == "native":
        raise DecodeUnsupported("speculative decoding rolls the cache back after a rejected draft; the model's own "
                                "cache (policy native) cannot be: use a decoder of policy share or recompute")


@dataclass
class _Block:
    """One block's outcome: y [B, q] full-depth tokens, logp [B, q, V], m [B] leading agreements, a (tokens emitted),
    and its phases' wall times (draft, verify, accept; seconds)."""

    y: torch.Tensor
    logp: torch.Tensor
    m: torch.Tensor
    a: int
    draft_s: float
    verify_s: float
    accept_s: float


def _block(dec: LoopDecoder, cur: torch.Tensor, dd: int, k: int) -> _Block:
    """Draft ``dd`` tokens after ``cur`` [B] at the decoder's position, verify, accept (module docstring, steps
    1–3); the decoder's position is left at the block's start (the caller rolls it forward by ``a``)."""
    chunk = dec.chunk_verify
    p = dec.pos
    t0 = time.perf_counter()
    ids, injs, hs = [cur], [], []
    for j in range(dd + 1 if chunk else dd):
        inj, h = dec.start(ids[j])
        for t in range(k):
            h = dec.step(t, h, inj, None)
        if chunk:
            hs.append(h)
            if inj is not None:  # (Ouro and retrofit re-inject nothing)
                injs.append(inj)
        if j < dd:
            ids.append(dec.readout(h, k - 1, None)[:, 0].argmax(dim=-1))
        dec.advance()
    dec.pos = p
    x = torch.stack(ids, dim=1)  # [B, q]
    inj_c = torch.cat(injs, dim=1) if injs else None
    t1 = time.perf_counter()
    z = dec.verify(x, inj_c, torch.cat(hs, dim=1) if chunk else None, k)  # [B, q, V]
    t2 = time.perf_counter()
    logp = torch.log_softmax(z.double(), dim=-1)
    y = logp.argmax(dim=-1)  # [B, q]: the full-depth greedy token after each position
    m = torch.cumprod((x[:, 1:] == y[:, :dd]).long(), dim=1).sum(dim=1)  # [B] leading agreements
    a = int(m.min()) + 1
    dec.pos = p
    return _Block(y, logp, m, a, t1 - t0, t2 - t1, time.perf_counter() - t2)


def _block_loops(dec: LoopDecoder, dd: int, k: int, batch: int) -> int:
    """Loop steps of a block over rows and positions: the drafts' k loops, the verification's T − k (chunk) or T."""
    T = dec.n_loops
    if dec.chunk_verify:
        return (dd + 1) * k * batch + (dd + 1) * (T - k) * batch
    return dd * k * batch + (dd + 1) * T * batch


@torch.inference_mode()
def decode_speculative(dec: LoopDecoder, prompts: torch.Tensor, new_tokens: int, k: int, d: int) -> SpecRun:
    """Greedy decoding of ``new_tokens`` tokens after each prompt by loop self-speculation (module docstring).

    Args:
        dec: the model's decoder (any policy but ``native``; the policy plays no part).
        prompts: [batch, prompt_len ≥ 1] int64 token ids.
        new_tokens: tokens to emit per row.
        k: draft loops, 1 ≤ k < T.
        d: draft length (tokens proposed per block).

    Returns:
        :class:`SpecRun` (numpy arrays); ``tokens`` equal :func:`looptrace.online.generate.decode_tokens` without
        a rule, bit for bit on looptrace's model (tests/test_speculative.py).
    """
    B, S0 = prompts.shape
    if S0 < 1 or new_tokens < 1:
        raise ValueError("decoding needs a prompt of at least one token and at least one new token")
    check_speculative(dec, k, d)
    N = new_tokens
    dev = prompts.device
    tokens = torch.zeros((B, N), dtype=torch.int64, device=dev)
    logprob = torch.zeros((B, N), dtype=torch.float64, device=dev)
    draft, emitted, accepted = [], [], []
    dec.reset(prompts, S0 + N - 1)
    t0 = time.perf_counter()
    dec.prefill(prompts[:, :-1])
    t1 = time.perf_counter()
    cur = prompts[:, -1]
    n = work = 0
    while n < N:
        dd = min(d, N - n - 1)
        b = _block(dec, cur, dd, k)
        a = b.a
        tokens[:, n:n + a] = b.y[:, :a]
        logprob[:, n:n + a] = b.logp[:, :a].gather(2, b.y[:, :a, None]).squeeze(2)
        draft.append(dd)
        emitted.append(a)
        accepted.append(b.m)
        work += _block_loops(dec, dd, k, B)
        n += a
        dec.pos += a
        cur = b.y[:, a - 1]
    t2 = time.perf_counter()
    return SpecRun(tokens=tokens.cpu().numpy(), logprob=logprob.cpu().numpy(),
                   draft=np.asarray(draft, np.int64), emitted=np.asarray(emitted, np.int64),
                   accepted=torch.stack(accepted).cpu().numpy().astype(np.int64), row_loops=work,
                   seconds=t2 - t1, prefill_seconds=t1 - t0)


# ----------------------------------------------------------------------------------------------
# The cost model's measurements
# ----------------------------------------------------------------------------------------------


@torch.inference_mode()
def measure_costs(dec: LoopDecoder, prompts: torch.Tensor, k: int, d: int, new_tokens: int, repeats: int = 3
                  ) -> SpecCosts:
    """Time full-depth decoding and a block of every draft length d' = 0..min(d, N − 1) on ``prompts``, back to
    back within each repeat (so load drift on a shared machine moves both alike); medians over ``repeats`` (after
    one untimed pass).

    Full depth: :func:`looptrace.online.generate.decode_tokens` of ``new_tokens`` tokens without a rule, its decode
    time per position. A block: the block's own code (:func:`decode_speculative` runs the same) at the prompt's
    last token (the rest prefilled), its draft, verification and acceptance phases.

    Args:
        dec: the decoder (as :func:`decode_speculative`'s).
        prompts: [batch, prompt_len] int64 (the batch the costs are for).
        k, d: draft loops and draft length.
        new_tokens: the full-depth decode's length.
        repeats: timed repetitions (≥ 1).

    Returns:
        :class:`~looptrace.online.speculative_predict.SpecCosts` (seconds).
    """
    from looptrace.online.generate import decode_tokens

    check_speculative(dec, k, d)
    B, S0 = prompts.shape
    d_max = min(d, new_tokens - 1)  # the longest draft a decode of new_tokens makes
    times: list[list[tuple[float, float, float]]] = [[] for _ in range(d_max + 1)]
    full: list[float] = []
    for rep in range(repeats + 1):
        f = decode_tokens(dec, prompts, new_tokens).seconds / new_tokens
        dec.reset(prompts, S0 + d_max)
        dec.prefill(prompts[:, :-1])
        for dd in range(d_max + 1):
            b = _block(dec, prompts[:, -1], dd, k)
            if rep > 0:
                times[dd].append((b.draft_s, b.verify_s, b.accept_s))
        if rep > 0:
            full.append(f)
    med = statistics.median
    return SpecCosts(draft=tuple(med(t[0] for t in ts) for ts in times),
                     verify=tuple(med(t[1] for t in ts) for ts in times),
                     accept=tuple(med(t[2] for t in ts) for ts in times), chunk=bool(dec.chunk_verify),
                     full=med(full))


# ----------------------------------------------------------------------------------------------
# The generate stage's section
# ----------------------------------------------------------------------------------------------


#: ``speculative.parquet`` columns (one row per model × k × d × batch size).
SPECULATIVE_SCHEMA = {
    "model": "str", "task": "str", "regime": "str", "regime_kind": "str", "k": "int", "d": "int",
    "batch_size": "int", "n_prompts": "int", "prompt_len": "int", "new_tokens": "int", "n_loops": "int",
    "verify": "str", "exact": "bool",
    "realised_blocks": "float", "realised_tokens_per_block": "float", "realised_tokens_per_block_lo": "float",
    "realised_tokens_per_block_hi": "float", "realised_row_accept": "float",
    "predicted_tokens_per_block": "float", "predicted_tokens_per_block_lo": "float",
    "predicted_tokens_per_block_hi": "float", "predicted_accept_steady": "float",
    "predicted_accept_steady_lo": "float", "predicted_accept_steady_hi": "float",
    "full_time_s": "float", "spec_time_s": "float",
    "realised_speedup": "float", "realised_speedup_lo": "float", "realised_speedup_hi": "float",
    "predicted_speedup": "float", "predicted_speedup_lo": "float", "predicted_speedup_hi": "float",
    "speedup_ratio": "float", "continuation_agreement": "float", "continuation_tokens_per_block": "float",
    "continuation_speedup": "float", "cost_model_ratio": "float", "work_ratio": "float", "store_agreement": "float", "store_sequences": "int",
    "cost_block_s": "float", "cost_draft_s": "float", "cost_verify_s": "float", "cost_accept_s": "float",
    "cost_verify_one_s": "float", "full_cost_s": "float", "repeats": "int",
}


class _ArgmaxProbe(OnlineRule):
    """Never fires; records the readout's argmax after every loop 1..T−1 of every decoded position (the full-depth
    continuation's own a_k: what a store of the decoded sequences would hold)."""

    def __init__(self) -> None:
        super().__init__("argmax_probe", 0.0, "ge")
        self.rows: list[list[torch.Tensor]] = []

    def reset(self, model, h0):
        self.rows.append([])

    def fires(self, t, h, z, model):
        self.rows[-1].append(z[:, 0].argmax(dim=-1))
        return torch.zeros(h.shape[:2], dtype=torch.bool, device=h.device)


def continuation_agreement(dec: LoopDecoder, prompts: torch.Tensor, new_tokens: int) -> np.ndarray:
    """[batch, N, T−1] bool: argmax_k = argmax_T (k = 1..T−1) at each decoded position of the full-depth greedy
    continuation (one untimed decode that reads out every loop). A draft whose earlier tokens are full depth's is
    exactly that loop-k readout when the model has no coda (with a coda, the drafts see their own loop-k coda
    keys/values), so :func:`~looptrace.online.speculative_predict.simulate_blocks` on it gives the blocks."""
    from looptrace.online.generate import decode_tokens

    probe = _ArgmaxProbe()
    r = decode_tokens(dec, prompts, new_tokens, probe)
    am = torch.stack([torch.stack(row, dim=1) for row in probe.rows], dim=1).cpu().numpy()  # [B, N, T−1]
    return am == r.tokens[:, :, None]


def _full_runs(dec: LoopDecoder, prompts: torch.Tensor, bs: int, N: int):
    """Full-depth greedy decoding of every prompt in batches of ``bs`` (the reference tokens, and its time)."""
    from looptrace.online.generate import decode_tokens

    toks, seconds, loops = [], 0.0, 0
    for lo in range(0, prompts.shape[0], bs):
        r = decode_tokens(dec, prompts[lo:lo + bs], N)
        toks.append(r.tokens)
        seconds += r.seconds
        loops += r.row_loops
    return np.concatenate(toks, axis=0), seconds, loops


def _spec_runs(dec: LoopDecoder, prompts: torch.Tensor, bs: int, N: int, k: int, d: int):
    runs = [decode_speculative(dec, prompts[lo:lo + bs], N, k, d) for lo in range(0, prompts.shape[0], bs)]
    return runs, sum(r.seconds for r in runs)


def speculative_model(dec: LoopDecoder, prompts: np.ndarray, store: dict[str, np.ndarray] | None,
                      cfg: SpeculativeConfig, batch_sizes: Sequence[int], new_tokens: int, repeats: int,
                      meta: dict, n_boot: int, level: float, seed: int, device: str = "cpu"
                      ) -> tuple[list[dict], dict[str, str]]:
    """Speculative decoding of one model at every k × d × batch size: exactness against full depth, realised
    acceptance and speedup (paired with full depth per repeat), predicted ones from the store.

    Args:
        dec: the model's decoder (a policy other than native).
        prompts: [n, prompt_len] int64.
        store: the test store's ``argmax`` [token, T], ``sequence`` and ``position`` [token] (the prediction's
            agreement runs), or None (no prediction: NaN).
        cfg: ``generate.speculative``.
        batch_sizes, new_tokens, repeats: ``generate``'s.
        meta: model, task, regime, regime_kind (copied into every row).
        n_boot, level, seed: the bootstrap of the prediction's intervals (``intervals``; seed from
            :func:`looptrace.intervals.boot_seed`).

    Returns:
        (rows of :data:`SPECULATIVE_SCHEMA`, skipped settings with reasons).
    """
    from looptrace.intervals import Resampler, percentile_interval

    T = dec.n_loops
    p_all = torch.from_numpy(prompts).to(device)
    N, n = new_tokens, prompts.shape[0]
    rows, skipped = [], {}
    ks = [k for k in cfg.k if k < T]
    for k in cfg.k:
        if k >= T:
            skipped[f"speculative:k={k}"] = f"a draft needs k < T = {T} loops"
    rs = None
    if store is not None and n_boot > 0:
        rs = Resampler(store["sequence"], n_boot, seed=seed, level=level)
    # the continuations' own agreement (the decoded sequences as a store would hold them): one decode of every
    # prompt together (a row's tokens do not depend on its batch), split into each batch size's prompt batches
    agree_all = continuation_agreement(dec, p_all, N) if ks else None
    for bs in batch_sizes:
        cont = [agree_all[lo:lo + bs] for lo in range(0, n, bs)] if agree_all is not None else []
        settings = [(k, d) for k in ks for d in cfg.d]
        realised: dict = {}
        times: dict = {None: [], **{s: [] for s in settings}}
        # Paired: full depth, then every setting, within each repeat (the runs are deterministic: the last
        # repeat's are the ones reported; the rule runs just before warmed the model up).
        for _ in range(repeats):
            full_tok, t, full_loops = _full_runs(dec, p_all, bs, N)
            times[None].append(t)
            for k, d in settings:
                realised[(k, d)], t = _spec_runs(dec, p_all, bs, N, k, d)
                times[(k, d)].append(t)
        t_full = statistics.median(times[None])
        for k, d in settings:
            runs = realised[(k, d)]
            tok = np.concatenate([r.tokens for r in runs], axis=0)
            ratios = [f / s for f, s in zip(times[None], times[(k, d)], strict=True)]
            costs = measure_costs(dec, p_all[:bs], k, d, N, cfg.cost_repeats)
            dm = min(d, N - 1)  # the longest block of the run
            emitted = np.concatenate([r.emitted for r in runs])
            unit = np.concatenate([np.full(r.blocks, i) for i, r in enumerate(runs)])
            tpb = float(emitted.sum() / emitted.size)
            # realised tokens per block over the prompt batches (each batch one resampling unit)
            if n_boot > 0 and len(runs) > 1:
                rr = Resampler(unit, n_boot, seed=seed + 1, level=level)
                lo_r, hi_r = percentile_interval(rr.ratio(emitted.astype(float), np.ones(emitted.size)), level)
            else:
                lo_r = hi_r = np.asarray(tpb)
            acc_rows = np.concatenate([r.accepted.ravel() for r in runs])
            pred = predict_speculative(store, k, d, bs, N, costs, rs) if store is not None else None
            work = full_loops / max(1, sum(r.row_loops for r in runs))
            sim = [simulate_blocks(c[:, :, k - 1], d) for c in cont]
            cont_tpb = float(sum(int(e.sum()) for _, e in sim) / sum(e.size for _, e in sim))
            cont_time = float(np.mean([sum(costs.block(int(dd)) for dd in dr) for dr, _ in sim]))
            sp = statistics.median(ratios)
            nan = float("nan")
            rows.append({
                **{key: meta.get(key) for key in ("model", "task", "regime", "regime_kind")},
                "k": int(k), "d": int(d), "batch_size": int(bs), "n_prompts": int(n), "prompt_len": int(prompts.shape[1]),
                "new_tokens": int(N), "n_loops": int(T), "verify": "chunk" if costs.chunk else "per_position",
                "exact": bool(np.array_equal(tok, full_tok)),
                "realised_blocks": float(np.mean([r.blocks for r in runs])), "realised_tokens_per_block": tpb,
                "realised_tokens_per_block_lo": float(lo_r), "realised_tokens_per_block_hi": float(hi_r),
                "realised_row_accept": float(acc_rows.mean() + 1) if acc_rows.size else nan,
                "predicted_tokens_per_block": pred["tokens_per_block"] if pred else nan,
                "predicted_tokens_per_block_lo": pred["tokens_per_block_lo"] if pred else nan,
                "predicted_tokens_per_block_hi": pred["tokens_per_block_hi"] if pred else nan,
                "predicted_accept_steady": pred["accept_steady"] if pred else nan,
                "predicted_accept_steady_lo": pred["accept_steady_lo"] if pred else nan,
                "predicted_accept_steady_hi": pred["accept_steady_hi"] if pred else nan,
                "full_time_s": t_full, "spec_time_s": statistics.median(times[(k, d)]),
                "realised_speedup": sp, "realised_speedup_lo": min(ratios), "realised_speedup_hi": max(ratios),
                "predicted_speedup": pred["speedup"] if pred else nan,
                "predicted_speedup_lo": pred["speedup_lo"] if pred else nan,
                "predicted_speedup_hi": pred["speedup_hi"] if pred else nan,
                "speedup_ratio": sp / pred["speedup"] if pred else nan,
                "continuation_agreement": float(np.mean(np.concatenate([c[:, :, k - 1].ravel() for c in cont]))),
                "continuation_tokens_per_block": cont_tpb, "continuation_speedup": N * costs.full / cont_time,
                "cost_model_ratio": sp / (N * costs.full / cont_time), "work_ratio": work,
                "store_agreement": pred["agreement"] if pred else nan,
                "store_sequences": int(pred["n_sequences"]) if pred else 0,
                "cost_block_s": costs.block(dm), "cost_draft_s": costs.draft[dm], "cost_verify_s": costs.verify[dm],
                "cost_accept_s": costs.accept[dm], "cost_verify_one_s": costs.verify[0], "full_cost_s": costs.full,
                "repeats": int(repeats),
            })
    return rows, skipped


class SpeculativeStage:
    """The ``generate`` stage's speculative section over its models: called once per model after its rules
    (:func:`looptrace.online.generate.generate_models`'s ``after_model``), with the model's ``recompute`` decoder
    (its cache is looptrace's, so it rolls back) and its opened test store's argmax runs.

    Args:
        cfg: ``generate.speculative``.
        batch_sizes, new_tokens, repeats: ``generate``'s.
        n_boot, level: ``intervals``.
        seed: ``base.seed`` (each model's bootstrap seed is :func:`looptrace.intervals.boot_seed` of it, the model
            and ``speculative``).
        device: torch device.

    Attributes:
        rows: the rows so far (:data:`SPECULATIVE_SCHEMA`).
    """

    def __init__(self, cfg: SpeculativeConfig, batch_sizes: Sequence[int], new_tokens: int, repeats: int,
                 n_boot: int, level: float, seed: int = 0, device: str = "cpu"):
        self.cfg, self.batch_sizes, self.new_tokens, self.repeats = cfg, tuple(batch_sizes), new_tokens, repeats
        self.n_boot, self.level, self.seed, self.device = n_boot, level, seed, device
        self.rows: list[dict] = []

    def __call__(self, name: str, model, store, prompts: np.ndarray, meta: dict) -> dict[str, str]:
        """Run one model; returns the settings skipped with reasons (``speculative`` when the model cannot be
        decoded this way)."""
        from looptrace.intervals import boot_seed
        from looptrace.models.decoders import decoder_for

        try:
            dec = decoder_for(model, "recompute", seed=self.seed)
        except DecodeUnsupported as exc:
            return {"speculative": str(exc)}
        arrays = {a: np.asarray(store.read(a)) for a in ("argmax", "sequence", "position")}
        rows, skipped = speculative_model(dec, prompts, arrays, self.cfg, self.batch_sizes, self.new_tokens,
                                          self.repeats, meta, self.n_boot, self.level,
                                          boot_seed(self.seed, name, "speculative"), self.device)
        self.rows += rows
        return skipped

    def frame(self):
        """The rows as ``speculative.parquet``'s frame."""
        return speculative_frame(self.rows)

    def metrics(self) -> dict:
        """``metrics.json``'s ``speculative`` entry."""
        return speculative_metrics(self.rows)


def speculative_metrics(rows: Sequence[dict]) -> dict:
    """``metrics.json``'s ``speculative`` entry: per model × k × d × batch size the realised and predicted tokens
    per block and speedups (every figure with its interval is in speculative.parquet)."""
    out: dict = {"n_runs": len(rows), "all_exact": bool(all(r["exact"] for r in rows)), "runs": {}}
    for r in rows:
        out["runs"][f"{r['model']}_k{r['k']}_d{r['d']}_bs{r['batch_size']}"] = {
            key: r[key] for key in ("exact", "realised_tokens_per_block", "predicted_tokens_per_block",
                                    "continuation_tokens_per_block", "realised_speedup", "predicted_speedup",
                                    "continuation_speedup", "speedup_ratio", "cost_model_ratio")}
    for key in ("speedup_ratio", "cost_model_ratio"):
        v = [r[key] for r in rows if np.isfinite(r[key])]
        out[f"median_{key}"] = float(np.median(v)) if v else None
    return out


def speculative_frame(rows: Sequence[dict]):
    """The rows as a polars frame of :data:`SPECULATIVE_SCHEMA`."""
    import polars as pl

    kinds = {"str": pl.String, "int": pl.Int64, "float": pl.Float64, "bool": pl.Boolean}
    return pl.DataFrame(list(rows), schema={k: kinds[v] for k, v in SPECULATIVE_SCHEMA.items()})


__all__ = ["SPECULATIVE_SCHEMA", "SpecRun", "SpeculativeConfig", "SpeculativeStage", "check_speculative",
           "continuation_agreement", "decode_speculative", "measure_costs", "speculative_frame", "speculative_metrics",
           "speculative_model"]
