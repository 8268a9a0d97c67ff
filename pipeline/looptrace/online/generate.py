"""Generation-time early exit (the ``generate`` stage): greedy decoding where every new token loops until its
exit rule fires, with a named KV policy for the loops it skipped.

This is where early exit pays in a looped LM (SPEC §8, docs/generate.md): positions are decoded one at a
time, so a token that exits at loop d really costs d loops — unlike the prefill of the ``latency`` stage, where
a causal position keeps looping while a later one is undecided. The price is that the token leaves no
keys/values for loops d+1..T that later tokens attend to; the KV policy says what they see there
(:mod:`looptrace.models.decode`):

- ``share`` — the exit loop's keys/values are copied into the skipped loops (Huginn's ``latest-m4``:
  recompute-free, the saving is real);
- ``recompute`` — the skipped loops are computed for the KV only (no saving; the exactness reference:
  the cache is exactly full depth's, only the emitted token comes from loop d; with a rule that never
  exits it *is* full-depth greedy decoding);
- ``native`` — the model's own policy: Huginn's cache lookup strategy (its ``HuginnDynamicCache``, rows in
  lockstep as in its ``generate_with_adaptive_compute``), Ouro's (every token runs all T steps; the exit only
  picks the readout: no saving), Dory's ``last_loop`` cache mode. looptrace's own model has none.

Decoding (:func:`decode_tokens`): the prompt's positions but the last run at full depth (prefill); then each
step feeds one position (the prompt's last token, then each emitted token) and loops it. After loop t the
rule (any rule of the readouts registry at its chosen threshold — :class:`~looptrace.online.engine.
RegistryRule`, the native Q-exit, a refit gate — :class:`~looptrace.online.engine.CallableRule`) sees h_t and
the readout z_t of the still-undecided rows, on signals computed by the functions the dump used
(:class:`~looptrace.online.live_signals.LiveSignals`); it fires → the row's token is argmax z_t. **Per-row exits in
a batch: compaction** — an exited row leaves the batch for the rest of that position (``index_select`` of the
active rows; the cache reads/writes only those rows), so it pays no more compute; it rejoins for the next
position. ``compact=False`` keeps exited rows computing (masking, for the benchmark's comparison; the KV
policy is applied after the position, so the tokens are the same).

Quality is measured against full-depth greedy decoding (the same code path with no rule: T loops, one readout):
the agreement of the emitted tokens, and the per-token loss of the full-depth continuation under the early-exit
run (teacher-forced: the early-exit model is fed the full-depth tokens and scored on them at its exit loops).
"""

from __future__ import annotations

import copy
import functools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import polars as pl
import torch
from tqdm.auto import tqdm

from looptrace.config import ConfigError, InputError, MissingInputError
from looptrace.io.artifacts import atomic_dir, jsonable
from looptrace.io.parallel import map_models
from looptrace.io.parquet import write_parquet
from looptrace.io.store.format import check_store_format_at
from looptrace.io.store.identity import check_store_model
from looptrace.io.store.reader import open_store
from looptrace.models.adapters.loading import load_adapter
from looptrace.models.decode import NATIVE_MODES, POLICIES, DecodeUnsupported, LoopDecoder
from looptrace.models.decoders import decoder_for
from looptrace.models.interface import file_sha256
from looptrace.models.looped import load_checkpoint
from looptrace.online.engine import OnlineRule, RegistryRule
from looptrace.online.genrun import GenRun
from looptrace.online.latency import GATE, RuleSpec, load_gate_rule, load_test_data, readout_rule_specs
from looptrace.online.lookahead import decode_tokens_lookahead
from looptrace.online.speculative_predict import SpeculativeConfig
from looptrace.rules.registry import ExitRule, get_rule, resolve_rules
from looptrace.tasks.text import text_splits

if TYPE_CHECKING:
    from looptrace.models.interface import LoopedModelAdapter
    from looptrace.models.looped import LoopedTransformer

# ----------------------------------------------------------------------------------------------
# Decoding with early exit
# ----------------------------------------------------------------------------------------------


def _subset(idx: torch.Tensor, batch: int) -> torch.Tensor | None:
    """``idx`` as a rows argument: None when it is every row in order (the cache's no-copy path)."""
    return None if idx.numel() == batch else idx


@torch.inference_mode()
def decode_tokens(dec: LoopDecoder, prompts: torch.Tensor, new_tokens: int, rule: OnlineRule | None = None,
                  force: torch.Tensor | None = None, compact: bool = True, trace: list | None = None,
                  lookahead: bool = False) -> GenRun:
    """Greedy decoding of ``new_tokens`` tokens after each prompt, every token looping until ``rule`` fires.

    Args:
        dec: the model's decoder (its ``policy`` is the KV policy).
        prompts: [batch, prompt_len ≥ 1] int64 token ids.
        new_tokens: tokens to emit per row.
        rule: the online exit rule (reset at every position; fires after loop t), or None for full depth.
        force: [batch, new_tokens] tokens to feed back instead of the emitted ones (teacher forcing).
        compact: exited rows leave the batch (default) or keep computing (masking).
        trace: if a list, ``(n, t, rows, h, z)`` per loop run and ``(n, -1, rows, h_init, None)`` per position
            (rows = global batch rows; tests).
        lookahead: decode with the stop decision kept on the device and read one loop late
            (:func:`looptrace.online.lookahead.decode_tokens_lookahead`: no host round trip per loop; masking;
            ``compact`` and ``trace`` do not apply). Same tokens, exit depths and log-probs as ``compact=False``.

    Returns:
        :class:`GenRun` (numpy arrays).
    """
    if lookahead:
        return decode_tokens_lookahead(dec, prompts, new_tokens, rule, force)
    B, S0 = prompts.shape
    if S0 < 1 or new_tokens < 1:
        raise ValueError("decoding needs a prompt of at least one token and at least one new token")
    T = dec.n_loops
    policy = dec.policy
    if policy == "native" and dec.native not in NATIVE_MODES:
        raise DecodeUnsupported(f"KV policy native: {dec.native_name}")
    mode = dec.native if policy == "native" else "compact"
    dev = prompts.device
    tokens = torch.zeros((B, new_tokens), dtype=torch.int64, device=dev)
    depth = torch.zeros((B, new_tokens), dtype=torch.int64, device=dev)
    logprob = torch.zeros((B, new_tokens), dtype=torch.float64, device=dev)
    all_rows = torch.arange(B, device=dev)
    dec.reset(prompts, S0 + new_tokens - 1)
    t0 = time.perf_counter()
    dec.prefill(prompts[:, :-1])
    t1 = time.perf_counter()
    cur = prompts[:, -1]
    work = 0
    for n in range(new_tokens):
        inj_all, h = dec.start(cur)
        inj = inj_all
        if trace is not None:
            trace.append((n, -1, all_rows.clone(), h.clone(), None))
        if rule is not None:
            rule.reset(dec, h)
        active, rows = all_rows, None
        und = torch.ones(B, dtype=torch.bool, device=dev)
        # The exit states: recompute continues from them; masking (compact=False) re-reads them out after the
        # position, because the exited rows' later readouts overwrote their coda keys/values.
        h_exit = torch.empty_like(h) if (policy == "recompute" or not compact) else None
        for t in range(T):
            h = dec.step(t, h, inj, rows)
            work += h.shape[0]
            last = t == T - 1
            if (rule is None and not last) or not bool(und.any()):
                continue  # full depth before T; or every row decided (mode "all": the loops still run)
            z = dec.readout(h, t, rows) if (last or (rule is not None and rule.needs_logits)) else None
            if trace is not None:
                trace.append((n, t, active.clone(), h.clone(), None if z is None else z.clone()))
            if last:
                fire = und.clone()
            else:
                assert rule is not None  # without a rule the loops before T were skipped above
                fire = rule.fires(t + 1, h, z, dec).reshape(-1) & und  # [b, 1] -> [b]
            if bool(fire.any()):
                loc = fire.nonzero().squeeze(1)
                r = active[loc]
                if z is None and mode in ("lockstep", "all"):  # the model's own cache: every row together
                    z = dec.readout(h, t, rows)
                zf = z[loc] if z is not None else dec.readout(h[loc], t, _subset(r, B))
                logp = torch.log_softmax(zf[:, 0].double(), dim=-1)
                emitted = logp.argmax(dim=-1)
                fed = emitted if force is None else force[r, n]
                tokens[r, n], depth[r, n] = emitted, t + 1
                logprob[r, n] = logp.gather(1, fed[:, None]).squeeze(1)
                if h_exit is not None and not last:
                    h_exit[r] = h[loc]
                und = und & ~fire
            if last:
                break
            if mode in ("lockstep", "all"):
                if mode == "lockstep" and not bool(und.any()):
                    break  # the batch loops until its last row exited (Huginn's adaptive generate)
                continue
            if not compact:  # masking: exited rows keep computing until the batch's last row exited
                if not bool(und.any()):
                    break
                continue
            keep = und.nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            if keep.numel() < active.numel():  # compaction: exited rows leave the batch
                active, h, und = active[keep], h[keep], und[keep]
                inj = inj[keep] if inj is not None else None
                rows = active
                if rule is not None:
                    rule.compact(keep, 1)
        d = depth[:, n]
        early = d < T
        if bool(early.any()):
            if policy == "share" or (policy == "native" and mode == "compact"):
                for dd in torch.unique(d[early]).tolist():  # rows that exited after loop dd share its KV
                    rs = (d == dd).nonzero().squeeze(1)
                    dec.share(_subset(rs, B), dd - 1)
                    if not compact and mode == "compact":  # restore the coda slot to the exit loop's readout
                        assert h_exit is not None  # allocated when not compact
                        dec.readout(h_exit[rs], dd - 1, _subset(rs, B))
            elif policy == "recompute":  # the skipped loops, for the KV only; then the coda at loop T
                assert h_exit is not None  # allocated for recompute
                for t in range(int(d.min()), T):
                    rs = (d <= t).nonzero().squeeze(1)
                    sub = _subset(rs, B)
                    h_exit[rs] = dec.step(t, h_exit[rs], None if inj_all is None else inj_all[rs], sub)
                    work += rs.numel()
                rs = early.nonzero().squeeze(1)
                dec.readout(h_exit[rs], T - 1, _subset(rs, B))
        dec.advance()
        cur = tokens[:, n] if force is None else force[:, n]
    t2 = time.perf_counter()
    return GenRun(tokens=tokens.cpu().numpy(), exit_depth=depth.cpu().numpy(), logprob=logprob.cpu().numpy(),
                  row_loops=work, seconds=t2 - t1, prefill_seconds=t1 - t0)


# ----------------------------------------------------------------------------------------------
# The stage's configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateConfig:
    """``generate`` section of ``params.yaml``.

    Attributes:
        rules: exit rules, named as in ``readouts.rules`` (each at the threshold of its chosen point in
            ``readouts/<model>/chosen.parquet``; rules on the native gate — ``q_exit``, ``q_exit_<dtype>`` —
            only for models with one), ``gate`` (the best refit gate of ``gates/<model>/``), or
            ``name@threshold`` (an explicit threshold, e.g. Ouro's own ``q_exit_bfloat16@0.9``).
        policies: KV policies (``share``, ``recompute``, ``native``); ``native`` only where the model has one.
        batch_sizes: rows decoded together (1, and ≥ 8 for per-row exits).
        prompts: prompts (the first test sequences of the dump store: the task's test split, or the corpus's).
        prompt_len: tokens of each test sequence used as its prompt.
        new_tokens: tokens generated per prompt.
        warmup: extra untimed runs before the timed ones (the quality pass already warms up).
        repeats: timed runs; full depth and every rule are interleaved within each repeat (median reported).
        huginn_lookup_strategy: the ``native`` policy's cache lookup strategy for Huginn (its
            ``HuginnDynamicCache``; ``full`` is the model's generate default).
        seeds: run only the default matrix's models of these training seeds (``<task>-<regime>-s<seed>``);
            null = every model. Not applied to ``--models`` or an adapter.
        lookahead: decode without a host round trip per loop (the stop decision on the device, read one loop
            late: :mod:`looptrace.online.lookahead`; for an accelerator). Same tokens and exit depths; off by
            default (on a CPU its speculative loop is pure cost). Policies whose native mode is not ``compact``
            keep the per-loop path.
        speculative: loop self-speculative decoding (the stage runs :class:`looptrace.online.speculative.
            SpeculativeStage`): draft loops ``k`` and draft lengths ``d``, realised against predicted in
            ``speculative.parquet``; null = off.
        workers: models decoded side by side, one process each on its own core (null = one per core, as the
            other per-model stages; 1 = one at a time, so a timing shares the machine with nothing). An adapter's
            model or a text corpus's prompts always run in the stage's process.
    """

    rules: tuple[str, ...] = ("top1", "entropy", "kl_prev", "q_exit", "gate")
    policies: tuple[str, ...] = ("share", "recompute", "native")
    batch_sizes: tuple[int, ...] = (1, 8)
    prompts: int = 8
    prompt_len: int = 4
    new_tokens: int = 8
    warmup: int = 0
    repeats: int = 3
    huginn_lookup_strategy: str = "full"
    seeds: tuple[int, ...] | None = None
    lookahead: bool = False
    speculative: SpeculativeConfig | None = SpeculativeConfig()
    workers: int | None = None

    def pick(self, names: list[str]) -> list[str]:
        """The models of ``names`` (default-matrix names) that :attr:`seeds` selects."""
        if self.seeds is None:
            return names
        keep = {f"-s{s}" for s in self.seeds}
        return [n for n in names if any(n.endswith(k) for k in keep)]

    def __post_init__(self) -> None:
        resolve_rules([split_rule(r)[0] for r in self.rules if r != GATE], "generate.rules", online=True)
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"generate.workers must be ≥ 1 or null (one per core), got {self.workers}")
        for r in self.rules:
            split_rule(r)
        bad = [p for p in self.policies if p not in POLICIES]
        if bad or not self.policies:
            raise ConfigError(f"generate.policies must be a non-empty list of {', '.join(POLICIES)}; got {list(self.policies)}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ConfigError(f"generate.batch_sizes must be a non-empty list of sizes ≥ 1, got {list(self.batch_sizes)}")
        for key in ("prompts", "prompt_len", "new_tokens", "repeats"):
            if getattr(self, key) < 1:
                raise ConfigError(f"generate.{key} must be ≥ 1, got {getattr(self, key)}")
        if self.warmup < 0:
            raise ConfigError(f"generate.warmup must be ≥ 0, got {self.warmup}")


def split_rule(entry: str) -> tuple[str, float | None]:
    """``name`` or ``name@threshold`` of ``generate.rules`` -> (name, explicit threshold or None)."""

    if "@" not in entry:
        return entry, None
    name, _, thr = entry.rpartition("@")
    try:
        return name, float(thr)
    except ValueError:
        raise ConfigError(f"generate.rules: '{entry}': the threshold after @ must be a number") from None


#: ``generate.parquet`` columns (one row per model × rule × policy × batch size).
GENERATE_SCHEMA = {
    "model": pl.String, "task": pl.String, "regime": pl.String, "regime_kind": pl.String,
    "rule": pl.String, "kind": pl.String, "source": pl.String, "threshold": pl.Float64, "policy": pl.String,
    "batch_size": pl.Int64, "n_prompts": pl.Int64, "prompt_len": pl.Int64, "new_tokens": pl.Int64,
    "n_tokens": pl.Int64, "n_loops": pl.Int64, "mean_exit_depth": pl.Float64, "min_exit_depth": pl.Int64,
    "max_exit_depth": pl.Int64, "full_time_s": pl.Float64, "exit_time_s": pl.Float64,
    "full_time_iqr_s": pl.Float64, "exit_time_iqr_s": pl.Float64, "full_tokens_per_s": pl.Float64,
    "tokens_per_s": pl.Float64, "realised_speedup": pl.Float64, "ideal_speedup": pl.Float64,
    "speedup_ratio": pl.Float64, "work_speedup": pl.Float64, "token_agreement": pl.Float64,
    "prefix_agreement": pl.Float64, "loss_full_depth": pl.Float64, "loss_early_exit": pl.Float64,
    "loss_gap": pl.Float64, "forced_mean_exit_depth": pl.Float64, "prefill_time_s": pl.Float64,
    "repeats": pl.Int64, "warmup": pl.Int64,
}


# ----------------------------------------------------------------------------------------------
# One model
# ----------------------------------------------------------------------------------------------


def load_prompts(store_path: Path | str, n: int, prompt_len: int,
                 text_windows: Callable[[], np.ndarray] | None = None) -> tuple[np.ndarray, str]:
    """The first ``n`` test sequences of a dump store, cut to ``prompt_len`` tokens.

    Synthetic tasks: regenerated from the store's task and data seed and checked against it
    (:func:`looptrace.online.latency.load_test_data`). Text: the corpus's test windows, regenerated by
    ``text_windows`` (:func:`dump_text_windows`: the dump's own packing) and checked against every stored row —
    the store alone cannot give them, because the dump's prefix de-duplication leaves positions unscored (a
    window's first positions share their prefixes with other splits' windows). Without ``text_windows`` a text
    store must hold every position.

    Returns:
        ([n, prompt_len] int64 prompts, the store's hidden dtype).

    Raises:
        FileNotFoundError: no store; ValueError: too few sequences or positions, or windows that differ from the
        store's tokens (the corpus or tokenizer changed since the dump).
    """

    store_path = Path(store_path)
    if not store_path.exists():
        raise MissingInputError(f"{store_path} not found; run the dump stage first")
    check_store_format_at(store_path)
    st = open_store(store_path)
    task = st.attrs.get("task") or {}
    if task.get("kind") == "text":
        seq, pos, tok = st.read("sequence"), st.read("position"), st.read("token_id")
        n_seq, S = int(seq.max()) + 1, int(pos.max()) + 1
        if text_windows is not None:
            tokens = np.asarray(text_windows(), dtype=np.int64)
            if (tokens.shape[0] < n_seq or tokens.shape[1] < S
                    or not np.array_equal(tokens[seq.astype(np.int64), pos.astype(np.int64)], tok)):
                raise InputError(f"{store_path}: the corpus's test windows (dump.text) differ from the store's tokens; "
                                 "the corpus or the tokenizer changed since the dump: re-run the dump stage")
        elif seq.size != n_seq * S:
            raise InputError(f"{store_path}: {seq.size} rows != {n_seq} × {S} positions (de-duplicated prefixes); "
                             "the prompts need the corpus (dump.text)")
        else:
            tokens = np.zeros((n_seq, S), dtype=np.int64)
            tokens[seq, pos] = tok
        hidden_dtype = str((st.attrs.get("dtypes") or {}).get("hidden", "float16"))
    else:
        data, _, hidden_dtype = load_test_data(store_path)
        tokens = data.tokens
    if tokens.shape[0] < n or tokens.shape[1] < prompt_len:
        raise InputError(f"{store_path}: generate needs {n} test sequences of ≥ {prompt_len} tokens "
                         f"(generate.prompts, generate.prompt_len); the store has {tokens.shape[0]} of "
                         f"{tokens.shape[1]}")
    return np.ascontiguousarray(tokens[:n, :prompt_len]).astype(np.int64), hidden_dtype


def dump_text_windows(dump_cfg, vocab_size: int | None = None) -> np.ndarray:
    """[sequences, seq_len] int64: the test windows the LM dump packed from ``dump.text`` (the same
    :func:`looptrace.tasks.text.text_splits` call as the dump's, so the same tokens)."""

    ad = dump_cfg.adapter
    tok_path = dump_cfg.text.tokenizer or (ad.path if ad is not None else None)
    assert tok_path is not None  # the dump of a text store refused a config without one
    trust = bool(ad is not None and ad.trust_remote_code)
    return text_splits(dump_cfg.text, dump_cfg.sequences, tok_path, vocab_size, trust)["test"].tokens


def rule_specs(cfg: GenerateConfig, readouts_dir: Path, gates_dir: Path, n_tokens: int, has_gate: bool,
               hidden_dtype: str) -> tuple[list[RuleSpec], dict[str, str]]:
    """The rules of ``generate.rules`` as online rules at their thresholds, and the skipped ones with reasons."""
    specs: list[RuleSpec] = []
    skipped: dict[str, str] = {}
    for entry in cfg.rules:
        if entry == GATE:
            spec, reason = load_gate_rule(gates_dir, n_tokens, hidden_dtype)
            if spec is None:
                assert reason is not None  # no spec comes with its reason
                skipped[GATE] = reason
            else:
                specs.append(spec)
        elif "@" in entry:
            name, thr = split_rule(entry)
            assert thr is not None  # "name@threshold"
            r = get_rule(name)
            if r.needs_gate and not has_gate:
                skipped[entry] = "model has no native halting gate"
                continue

            def factory(r: ExitRule = r, thr: float = thr) -> OnlineRule:
                return RegistryRule(r, thr, hidden_dtype)

            specs.append(RuleSpec(rule=f"{r.name}@{thr:g}", kind=r.kind, source="explicit", threshold=float(thr),
                                  factory=factory, offline_exit=np.zeros(0, np.int64),
                                  offline_correct=np.zeros(0, bool)))
        else:
            sp, sk = readout_rule_specs(readouts_dir, [entry], n_tokens, has_gate, hidden_dtype)
            specs += sp
            skipped.update(sk)
    return specs, skipped


def _median_iqr(x: Sequence[float]) -> tuple[float, float]:
    q = np.quantile(np.asarray(x), [0.25, 0.75])
    return float(statistics.median(x)), float(q[1] - q[0])


@dataclass
class _Runs:
    """Every decoding run of one policy and batch size, concatenated over batches."""

    tokens: list[np.ndarray] = field(default_factory=list)
    depth: list[np.ndarray] = field(default_factory=list)
    logprob: list[np.ndarray] = field(default_factory=list)
    row_loops: int = 0
    seconds: float = 0.0
    prefill: float = 0.0

    def add(self, r: GenRun) -> None:
        self.tokens.append(r.tokens)
        self.depth.append(r.exit_depth)
        self.logprob.append(r.logprob)
        self.row_loops += r.row_loops
        self.seconds += r.seconds
        self.prefill += r.prefill_seconds

    def cat(self, name: str) -> np.ndarray:
        return np.concatenate(getattr(self, name), axis=0)


def run_batches(dec: LoopDecoder, prompts: torch.Tensor, batch_size: int, new_tokens: int,
                factory: Callable[[], OnlineRule] | None, force: np.ndarray | None = None,
                compact: bool = True, lookahead: bool = False) -> _Runs:
    """Decode every prompt in batches of ``batch_size`` (one fresh rule per batch; ``lookahead``: see
    :func:`decode_tokens`, ignored where the decoder's native mode needs the per-loop path)."""
    out = _Runs()
    lookahead = lookahead and not (dec.policy == "native" and dec.native != "compact")
    for lo in range(0, prompts.shape[0], batch_size):
        sl = slice(lo, min(prompts.shape[0], lo + batch_size))
        f = None if force is None else torch.from_numpy(force[sl]).to(prompts.device)
        out.add(decode_tokens(dec, prompts[sl], new_tokens, factory() if factory is not None else None, f, compact,
                              lookahead=lookahead))
    return out


def prefix_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of the fraction of tokens before the first disagreement ([rows, new] arrays)."""
    same = a == b
    first = np.where(same.all(axis=1), a.shape[1], np.argmin(same, axis=1))
    return float(np.mean(first / a.shape[1]))


def generate_model(decoders: dict[str, LoopDecoder], prompts: np.ndarray, specs: Sequence[RuleSpec],
                   cfg: GenerateConfig, meta: dict, device: str = "cpu", progress: bool = True) -> list[dict]:
    """Full depth and every rule × policy × batch size on one model: quality pass, then interleaved timing.

    Args:
        decoders: policy -> the model's decoder for it.
        prompts: [n, prompt_len] int64.
        specs: the online rules.
        cfg: the ``generate`` section.
        meta: model, task, regime, regime_kind (copied into every row).

    Returns:
        ``generate.parquet`` rows (:data:`GENERATE_SCHEMA`).
    """

    p_all = torch.from_numpy(prompts).to(device)
    N = cfg.new_tokens
    rows = []
    bar = tqdm(total=len(decoders) * len(cfg.batch_sizes) * (1 + cfg.warmup + cfg.repeats),
               desc=f"generate {meta.get('model')}", disable=None if progress else True, leave=False)
    for policy, dec in decoders.items():
        T = dec.n_loops
        for bs in cfg.batch_sizes:
            # Quality pass (untimed; also the warm-up): full depth, every rule free and teacher-forced.
            full = run_batches(dec, p_all, bs, N, None, lookahead=cfg.lookahead)
            full_tok, full_lp = full.cat("tokens"), full.cat("logprob")
            quality: dict[str, dict[str, Any]] = {}
            for sp in specs:
                free = run_batches(dec, p_all, bs, N, sp.factory, lookahead=cfg.lookahead)
                forced = run_batches(dec, p_all, bs, N, sp.factory, force=full_tok, lookahead=cfg.lookahead)
                tok, d = free.cat("tokens"), free.cat("depth")
                quality[sp.rule] = dict(
                    depth=d, agreement=float((tok == full_tok).mean()), prefix=prefix_agreement(tok, full_tok),
                    loss=float(-forced.cat("logprob").mean()), forced_depth=float(forced.cat("depth").mean()),
                    row_loops=free.row_loops)
            bar.update(1)
            times: dict[str | None, list[float]] = {None: [], **{sp.rule: [] for sp in specs}}
            runs = [(None, None)] + [(sp.rule, sp.factory) for sp in specs]
            prefill = []
            for rep in range(cfg.warmup + cfg.repeats):
                for key, factory in runs:
                    r = run_batches(dec, p_all, bs, N, factory, lookahead=cfg.lookahead)
                    if rep >= cfg.warmup:
                        times[key].append(r.seconds)
                        prefill.append(r.prefill)
                bar.update(1)
            t_full, iqr_full = _median_iqr(times[None])
            n_tok = prompts.shape[0] * N
            for sp in specs:
                q = quality[sp.rule]
                t_exit, iqr_exit = _median_iqr(times[sp.rule])
                mean_d = float(q["depth"].mean())
                realised = float(statistics.median(f / e for f, e in zip(times[None], times[sp.rule], strict=True)))
                ideal = T / mean_d
                loss_full = float(-full_lp.mean())
                rows.append({
                    **{k: meta.get(k) for k in ("model", "task", "regime", "regime_kind")},
                    "rule": sp.rule, "kind": sp.kind, "source": sp.source, "threshold": sp.threshold,
                    "policy": policy, "batch_size": int(bs), "n_prompts": int(prompts.shape[0]),
                    "prompt_len": int(prompts.shape[1]), "new_tokens": int(N), "n_tokens": int(n_tok),
                    "n_loops": int(T), "mean_exit_depth": mean_d, "min_exit_depth": int(q["depth"].min()),
                    "max_exit_depth": int(q["depth"].max()), "full_time_s": t_full, "exit_time_s": t_exit,
                    "full_time_iqr_s": iqr_full, "exit_time_iqr_s": iqr_exit, "full_tokens_per_s": n_tok / t_full,
                    "tokens_per_s": n_tok / t_exit, "realised_speedup": realised, "ideal_speedup": ideal,
                    "speedup_ratio": realised / ideal, "work_speedup": full.row_loops / q["row_loops"],
                    "token_agreement": q["agreement"], "prefix_agreement": q["prefix"],
                    "loss_full_depth": loss_full, "loss_early_exit": q["loss"], "loss_gap": q["loss"] - loss_full,
                    "forced_mean_exit_depth": q["forced_depth"], "prefill_time_s": float(statistics.median(prefill)),
                    "repeats": cfg.repeats, "warmup": cfg.warmup,
                })
    bar.close()
    return rows


# ----------------------------------------------------------------------------------------------
# The stage
# ----------------------------------------------------------------------------------------------


def model_decoders(model, cfg: GenerateConfig, seed: int = 0) -> tuple[dict[str, LoopDecoder], dict[str, str]]:
    """The decoder of every policy of ``generate.policies`` the model supports, and the others with reasons."""
    out, skipped = {}, {}
    for policy in cfg.policies:
        try:
            out[policy] = decoder_for(model, policy, huginn_lookup_strategy=cfg.huginn_lookup_strategy, seed=seed)
        except DecodeUnsupported as exc:
            skipped[f"policy:{policy}"] = str(exc)
    return out, skipped


def generate_models(models: Sequence[str], cfg: GenerateConfig, dump_root: Path | str, readouts_root: Path | str,
                    gates_root: Path | str, train_root: Path | str | None = None, adapter=None, device: str = "cpu",
                    seed: int = 0, regime_meta: Callable | None = None, progress: bool = True,
                    text_windows: Callable[[], np.ndarray] | None = None, after_model: Callable | None = None,
                    workers: int = 1, threads: int | None = None) -> tuple[pl.DataFrame, dict]:
    """The ``generate`` stage: every model's decoders × rules × batch sizes -> rows and metrics.

    Args:
        models: model names (with ``adapter``: exactly the adapter's run name).
        cfg: the ``generate`` section.
        dump_root, readouts_root, gates_root: artifact roots (prompts and hidden dtype; chosen points; gates).
        train_root: looptrace's own checkpoints (``<root>/<model>/model.pt``), when ``adapter`` is None.
        adapter: ``dump.adapter`` (an :class:`~looptrace.models.adapters.loading.AdapterConfig`) for a real LM.
        device: torch device.
        seed: ``base.seed`` (Huginn's random initial states).
        regime_meta: model name -> dict(model, task, regime, regime_kind).
        text_windows: () -> the corpus's test windows (a text store's prompts; :func:`dump_text_windows`).
        after_model: (name, model, test store, prompts, meta) -> {what: reason skipped}, called after each model's
            rules (the speculative section: :class:`looptrace.online.speculative.SpeculativeStage`, whose
            ``rows`` collect its results).
        workers: looptrace's own models decoded side by side, each in its own process
            (:func:`looptrace.io.parallel.map_models`; an ``after_model`` collects each worker's ``rows`` in model
            order); 1 = one after another in this process, as an adapter or a text corpus always runs. Every row
            but the wall times is the same bytes either way.
        threads: torch threads of each model's process (None = this process's).

    Returns:
        (generate frame, metrics dict; ``workers``: the processes the models were decoded in).
    """
    metas = {name: regime_meta(name) if regime_meta is not None else {"model": name} for name in models}
    if adapter is not None or text_windows is not None:
        workers = 1  # one real LM (its run name), or prompts drawn through a closure: this process
    workers = max(1, min(int(workers), len(models)))
    one = functools.partial(_generate_task, cfg=cfg, roots=(dump_root, readouts_root, gates_root, train_root),
                            adapter=adapter, device=device, seed=seed, metas=metas, progress=progress,
                            text_windows=text_windows, after_model=after_model, threads=threads,
                            in_process=workers == 1)
    results = map_models(one, list(models), workers, "generate")
    all_rows, skipped, info = [], {}, {}
    for name, (rows, skip, model_info, after_rows) in zip(models, results, strict=True):
        all_rows += rows
        skipped[name] = skip
        info[name] = model_info
        if after_rows:
            cast(Any, after_model).rows += after_rows
    df = pl.DataFrame(all_rows, schema=GENERATE_SCHEMA)
    return df, {**generate_metrics(df, skipped, info), "workers": workers}


def _generate_task(name: str, cfg: GenerateConfig, roots: tuple, adapter, device: str, seed: int, metas: dict,
                   progress: bool, text_windows, after_model, threads: int | None, in_process: bool
                   ) -> tuple[list[dict], dict, dict, list]:
    """One model of :func:`generate_models` -> (rows, skipped, info, the rows ``after_model`` added for it: it runs
    on a copy with no rows, whose rows the caller appends in model order whichever process ran it)."""
    if threads is not None:
        torch.set_num_threads(threads)
    if not in_process:
        torch.manual_seed(seed)  # a worker's process, seeded as the stage seeds its own
    if after_model is not None and hasattr(after_model, "rows"):
        after_model = copy.copy(after_model)
        after_model.rows = []
    dump_root, readouts_root, gates_root, train_root = roots
    rows, skip, info = generate_one(name, cfg, dump_root, readouts_root, gates_root, train_root, adapter=adapter,
                                    device=device, seed=seed, meta=metas[name], progress=progress,
                                    text_windows=text_windows, after_model=after_model)
    return rows, skip, info, list(getattr(after_model, "rows", []))


def generate_one(name: str, cfg: GenerateConfig, dump_root: Path | str, readouts_root: Path | str,
                 gates_root: Path | str, train_root: Path | str | None = None, adapter=None, device: str = "cpu",
                 seed: int = 0, meta: dict | None = None, progress: bool = True,
                 text_windows: Callable[[], np.ndarray] | None = None, after_model: Callable | None = None
                 ) -> tuple[list[dict], dict, dict]:
    """One model of the ``generate`` stage (:func:`generate_models`' arguments) -> (rows, skipped with reasons,
    model info)."""
    model: LoopedModelAdapter | LoopedTransformer
    if adapter is not None:
        if name != adapter.run_name:
            raise ConfigError(f"generate: model '{name}' is not dump.adapter's run name '{adapter.run_name}'")
        model = load_adapter(adapter, device)
        has_gate = bool(model.info.has_gate)
        ckpt, ckpt_hash = adapter.path, model.info.checkpoint_hash or None
    else:
        assert train_root is not None  # looptrace's own checkpoints without an adapter
        ckpt = Path(train_root) / name / "model.pt"
        model, _ = load_checkpoint(ckpt, name=name)
        model = model.to(device).eval()
        has_gate = model.gate is not None
        ckpt_hash = file_sha256(ckpt)
    store = Path(dump_root) / name / "test.zarr"
    check_store_format_at(store)
    st = open_store(store) if store.exists() else None  # (load_prompts names a missing store)
    if st is not None:  # identity first: load_prompts' own checks would blame the data instead
        check_store_model(st, name, ckpt_hash, str(ckpt))
    prompts, hidden_dtype = load_prompts(store, cfg.prompts, cfg.prompt_len, text_windows)
    assert st is not None  # load_prompts refused a missing store
    n_tokens = st.n_tokens
    specs, skip = rule_specs(cfg, Path(readouts_root) / name, Path(gates_root) / name, n_tokens, has_gate,
                             hidden_dtype)
    decoders, skip_p = model_decoders(model, cfg, seed)
    skip.update(skip_p)
    meta = meta if meta is not None else {"model": name}
    rows = generate_model(decoders, prompts, specs, cfg, meta, device, progress)
    if after_model is not None:
        skip.update(after_model(name, model, st, prompts, meta))
    info = {"n_loops": next(iter(decoders.values())).n_loops if decoders else None,
            "hidden_dtype": hidden_dtype, "policies": list(decoders),
            "native": {p: d.native_name for p, d in decoders.items() if p == "native"}}
    return rows, skip, info


def generate_metrics(df: pl.DataFrame, skipped: dict, info: dict) -> dict:
    """``metrics.json``: per policy and batch size the realised/ideal medians; per model the fastest rule and the
    skipped rules/policies with reasons. Every row's numbers are in generate.parquet."""
    models: dict = {name: dict(info.get(name, {})) for name in info}
    for (name, policy, bs), d in df.group_by(["model", "policy", "batch_size"], maintain_order=True):
        r = d.sort("realised_speedup", descending=True).row(0, named=True)
        models.setdefault(name, {})[f"fastest_{policy}_bs{bs}"] = {
            k: r[k] for k in ("rule", "mean_exit_depth", "tokens_per_s", "realised_speedup", "ideal_speedup",
                              "speedup_ratio", "token_agreement", "loss_gap")}
    for name, sk in skipped.items():
        if sk:
            models.setdefault(name, {})["skipped"] = sk
    summary = {}
    for (policy, bs), sub in df.group_by(["policy", "batch_size"], maintain_order=True):
        summary[f"{policy}_bs{bs}"] = {"median_speedup_ratio": float(cast(float, sub["speedup_ratio"].median())),
                                       "max_realised_speedup": float(cast(float, sub["realised_speedup"].max())),
                                       "runs_ratio_ge_0p8": int((sub["speedup_ratio"] >= 0.8).sum()),
                                       "median_token_agreement": float(cast(float, sub["token_agreement"].median())),
                                       "n_runs": sub.height}
    return {"n_runs": df.height, "summary": summary, "models": models}


def write_generate(out_dir: Path | str, df: pl.DataFrame, metrics: dict, spec: pl.DataFrame | None = None) -> None:
    """Write ``generate.parquet``, ``metrics.json`` and (``generate.speculative`` on) ``speculative.parquet``
    atomically."""

    with atomic_dir(out_dir) as tmp:
        write_parquet(df, tmp / "generate.parquet")  # page checksums
        if spec is not None:
            write_parquet(spec, tmp / "speculative.parquet")
        (tmp / "metrics.json").write_text(json.dumps(jsonable(metrics), indent=2) + "\n")


__all__ = ["GENERATE_SCHEMA", "GenRun", "GenerateConfig", "decode_tokens", "dump_text_windows", "generate_model",
           "generate_models", "load_prompts", "model_decoders", "prefix_agreement", "rule_specs", "run_batches", "split_rule",
           "write_generate"]
