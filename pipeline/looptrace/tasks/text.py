"""Text corpora as dump input: documents → tokens → packed next-token sequences (a :class:`TaskBatch`).

So that the dump, geometry, readouts, gates and diagnose stages run unchanged on a real language model,
a text corpus is turned into the same :class:`~looptrace.tasks.TaskBatch` the synthetic tasks produce:

- Documents come from a local JSONL (one JSON object per line, text in ``text.field``), Parquet (column
  ``text.field``) or plain-text file (documents separated by blank lines).
- Splits are disjoint by content, as for the tasks: document d goes to split ``sha256(d) mod 3``
  (0 fit, 1 val, 2 test), so no document is in two splits. Disjoint documents are not disjoint contexts: a
  scored position's trajectory is a function of its window prefix ``tokens[:pos+1]`` (causal attention), and
  short prefixes (a window's first tokens), boilerplate and duplicated text repeat across documents. With
  ``text.dedup_prefixes`` (default) every window prefix that is scored in two or more of the dumped splits is
  kept in exactly one of them and unscored (``targets = IGNORE``) in the others (:func:`dedup_prefixes`), so no
  scored prefix is shared between splits.
- Each split's documents are tokenised with the checkpoint's own tokenizer (``AutoTokenizer`` from the
  local directory), framed as ``[bos] doc [eos]`` when the tokenizer has those tokens, concatenated in file
  order and cut into windows of ``seq_len + 1`` tokens with stride ``seq_len``: ``tokens`` = the first
  ``seq_len``, ``targets`` = the next token of each. Every position is scored (but for the cross-split
  duplicates above); a trailing partial window is dropped.
- ``token_type`` per scored position, from the decoded text of the position's token (the input token —
  the token whose state converges, as in [FP]; or the target with ``text.token_type_of: target``):
  whitespace, punctuation, number, function word (a fixed English list, :data:`FUNCTION_WORDS`), content
  word, plus ``special`` (the tokenizer's special tokens) and ``other`` (e.g. a byte-level piece that is not
  valid UTF-8 by itself). Classification is per token, so a sub-word piece ``the`` of "theory" counts as a
  function word: that is a property of token-level typing, not a bug.
- ``difficulty`` (``text.difficulty``) must not be a function of the model being analysed, or "difficulty vs
  entropy" is nearly circular (a token the model finds hard has a high final loss *and* a high entropy by
  construction). The default, ``token_frequency``, is a property of the corpus alone: the add-one smoothed
  unigram surprisal of the target, u(y) = log((N + V) / (c(y) + 1)) nats, with c(y) the count of y among the
  N target tokens of the *fit* split's whole token stream (every fit document, however many windows are
  dumped) and V the model's vocabulary size; rare targets are hard. Bins (``difficulty_bins``, deciles) are
  the fit split's empirical quantiles k/n of u over those N tokens, applied to every split, so a level means
  the same in fit, val and test; bin b holds edges[b−1] < u ≤ edges[b] (equal values share a bin, so a very
  frequent token can leave some bins empty). Edges, N, V and the definition are in the store attributes
  (``difficulty_edges``, ``difficulty_counts``, ``difficulty_definition``); name ``unigram_surprisal_bin``.
  ``final_loss`` keeps the model-dependent alternative, the bin of the full-depth loss ℓ_T = −log p_T(y)
  among the split's tokens: it is only known after the forward pass, so the dump writes −1 first and
  :func:`loss_bins_finalizer` rewrites the column from the stored ``target_logprob`` at loop T before the
  store is marked complete (``dump_split(..., finalize=...)``), with per-split quantile edges; name
  ``final_loss_bin``.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from looptrace.config import ConfigError, InputError, MissingInputError, to_dict
from looptrace.tasks import IGNORE, SPLITS, TaskBatch
from looptrace.tasks.base import prefix_keys, shared_prefixes

TOKEN_TYPES = ("whitespace", "punctuation", "number", "function_word", "content_word", "special", "other")
#: ``text.difficulty`` -> the store's ``difficulty_name``.
DIFFICULTY_NAMES = {"token_frequency": "unigram_surprisal_bin", "final_loss": "final_loss_bin"}
#: One line per definition, recorded as ``difficulty_definition`` beside the data.
DIFFICULTY_DEFINITIONS = {
    "token_frequency": "bin of the target's add-one smoothed unigram surprisal log((N + V) / (c(y) + 1)) nats, "
                       "c counted over the N target tokens of the fit split's token stream, V = vocabulary size; "
                       "bins = fit quantiles (independent of the model)",
    "final_loss": "bin of the analysed model's full-depth loss -log p_T(y) among the split's tokens (per-split "
                  "quantiles; depends on the model)",
}

#: Closed-class English words (articles, determiners, pronouns, prepositions, conjunctions, auxiliaries,
#: modals, particles). Fixed so token types are reproducible; lower-cased match on the stripped token.
FUNCTION_WORDS = frozenset("""
a an the this that these those some any each every either neither no all both half several many much
few little more most less least other another such what which whose whatever whichever
i me my mine myself you your yours yourself yourselves he him his himself she her hers herself it its
itself we us our ours ourselves they them their theirs themselves one ones who whom whoever
about above across after against along amid among around as at before behind below beneath beside
besides between beyond by despite down during except for from in inside into like near of off on onto
out outside over past per since than through throughout till to toward towards under underneath unlike
until up upon via with within without
and or but nor so yet if because although though while whereas unless whether once when whenever where
wherever why how then else also too not n't
be am is are was were been being have has had having do does did doing done
will would shall should can could may might must ought
there here just only very again ever even
's 're 've 'd 'll 'm
""".split())

_NUMBER = re.compile(r"[0-9][0-9.,:_']*|[.,][0-9][0-9.,:_']*")


@dataclass(frozen=True)
class TextConfig:
    """``dump.text`` section: the corpus of a language-model dump.

    Attributes:
        path: local JSONL / Parquet / text file.
        format: ``auto`` (from the suffix: .jsonl/.json, .parquet, else text) | ``jsonl`` | ``parquet`` | ``text``.
        field: the text field (JSONL key / Parquet column).
        seq_len: tokens per sequence (each scored against the next token).
        tokenizer: tokenizer directory (default: ``dump.adapter.path``).
        add_bos: start each document with the tokenizer's BOS token (when it has one).
        add_eos: end each document with the tokenizer's EOS token (when it has one).
        token_type_of: ``input`` (the position's own token) or ``target`` (the token predicted).
        difficulty: ``token_frequency`` (unigram surprisal of the target from fit-split counts: a property of
            the corpus) or ``final_loss`` (the analysed model's full-depth loss; circular beside its own
            confidence signals). Module docstring.
        difficulty_bins: number of quantile bins of ``difficulty`` (10 = deciles).
        max_documents: read at most this many documents (null = all).
        short_splits: a split whose corpus yields fewer sequences than ``dump.sequences`` asks: ``refuse`` (default:
            one line naming the splits, got vs asked, before anything is written) or ``warn`` (one warning line,
            then dump what there is). The counts per split are reported either way.
        dedup_prefixes: unscore, in all but one split, every window prefix scored in several splits
            (:func:`dedup_prefixes`); false keeps the document-level split only.
    """

    path: str
    format: str = "auto"
    field: str = "text"
    seq_len: int = 512
    tokenizer: str | None = None
    add_bos: bool = True
    add_eos: bool = True
    token_type_of: str = "input"
    difficulty: str = "token_frequency"
    difficulty_bins: int = 10
    max_documents: int | None = None
    dedup_prefixes: bool = True
    short_splits: str = "refuse"

    def __post_init__(self) -> None:
        if self.format not in ("auto", "jsonl", "parquet", "text"):
            raise ConfigError(f"dump.text.format must be auto, jsonl, parquet or text; got {self.format!r}")
        if self.seq_len < 1:
            raise ConfigError(f"dump.text.seq_len must be >= 1, got {self.seq_len}")
        if self.token_type_of not in ("input", "target"):
            raise ConfigError(f"dump.text.token_type_of must be input or target, got {self.token_type_of!r}")
        if self.difficulty not in DIFFICULTY_NAMES:
            raise ConfigError(f"dump.text.difficulty must be token_frequency or final_loss, got {self.difficulty!r}")
        if self.short_splits not in ("refuse", "warn"):
            raise ConfigError(f"dump.text.short_splits must be refuse or warn; got {self.short_splits!r}")
        if self.difficulty_bins < 1:
            raise ConfigError(f"dump.text.difficulty_bins must be >= 1, got {self.difficulty_bins}")


# ---------------------------------------------------------------------------------------------
# Documents
# ---------------------------------------------------------------------------------------------

def read_documents(path: Path | str, fmt: str = "auto", field: str = "text",
                   max_documents: int | None = None) -> list[str]:
    """Documents of a local corpus file, in file order (empty documents dropped).

    Args:
        path: JSONL (one object per line), Parquet, or plain text (documents separated by blank lines).
        fmt: ``auto`` (by suffix), ``jsonl``, ``parquet`` or ``text``.
        field: JSONL key / Parquet column holding the text.
        max_documents: keep at most this many.

    Raises:
        ValueError: one line naming the file (and line / field) and the fix.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingInputError(f"dump.text.path '{path}' not found; point it at a local JSONL, Parquet or text file")
    if fmt == "auto":
        fmt = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}.get(
            path.suffix.lower(), "text")
    docs: list[str] = []
    if fmt == "jsonl":
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputError(f"{path}:{i}: not valid JSON ({exc.msg}); one JSON object per line") from None
                if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
                    raise ConfigError(f"{path}:{i}: no string field '{field}'; set dump.text.field")
                docs.append(obj[field])
                if max_documents is not None and len(docs) >= max_documents:
                    break
    elif fmt == "parquet":
        try:
            col = pl.read_parquet(path, columns=[field], n_rows=max_documents)[field]
        except Exception as exc:  # noqa: BLE001 - polars raises several types for a missing column / bad file
            raise ConfigError(f"{path}: cannot read column '{field}' ({type(exc).__name__}); set dump.text.field") from None
        if col.dtype != pl.String:
            raise ConfigError(f"{path}: column '{field}' is {col.dtype}, not text; set dump.text.field")
        docs = [d for d in col.to_list() if d is not None]
    else:
        text = path.read_text(encoding="utf-8")
        docs = [d.strip("\n") for d in re.split(r"\n\s*\n", text)]
    docs = [d for d in docs if d.strip()]
    if max_documents is not None:
        docs = docs[:max_documents]
    if not docs:
        raise InputError(f"{path}: no non-empty documents")
    return docs


def document_split(doc: str) -> int:
    """Split index of a document (0 fit, 1 val, 2 test): sha256 of its UTF-8 text mod 3."""
    return int.from_bytes(hashlib.sha256(doc.encode("utf-8")).digest()[:8], "little") % 3


# ---------------------------------------------------------------------------------------------
# Token types
# ---------------------------------------------------------------------------------------------

def classify_token_text(text: str, special: bool = False) -> int:
    """Token-type id (index into :data:`TOKEN_TYPES`) of one token's decoded text."""
    if special:
        return TOKEN_TYPES.index("special")
    t = text.strip()
    if not t:
        return TOKEN_TYPES.index("whitespace")
    if "\ufffd" in t:  # a byte-level piece that is not valid UTF-8 on its own
        return TOKEN_TYPES.index("other")
    if all(unicodedata.category(ch)[0] in "PS" for ch in t):
        return TOKEN_TYPES.index("punctuation")
    if _NUMBER.fullmatch(t):
        return TOKEN_TYPES.index("number")
    if t.lower() in FUNCTION_WORDS:
        return TOKEN_TYPES.index("function_word")
    if any(ch.isalpha() for ch in t):
        return TOKEN_TYPES.index("content_word")
    return TOKEN_TYPES.index("other")


def token_type_table(tokenizer, ids: np.ndarray) -> dict[int, int]:
    """Token-type id of each distinct token id in ``ids`` (decoded one token at a time)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    out = {}
    for i in np.unique(ids).tolist():
        text = tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        out[i] = classify_token_text(text, special=i in special)
    return out


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------

def load_tokenizer(path: Path | str, trust_remote_code: bool = False):
    """``AutoTokenizer`` of a local directory (no download).

    ``trust_remote_code``: the adapter's (``dump.adapter.trust_remote_code``). A directory whose config.json has an
    ``auto_map`` (Ouro, Huginn) is remote code to transformers even for the tokenizer: without it, transformers asks
    "Do you wish to run the custom code? [y/N]" on a terminal.
    """

    # lazy: transformers: a multi-second import, only once a tokenizer is loaded (tasks import light)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    try:
        if trust_remote_code:  # its 4.x-era config code makes transformers 5 print deprecation notices: known, harmless
            hf_logging.set_verbosity_error()
        with warnings.catch_warnings():
            if trust_remote_code:
                warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers(_modules)?(\.|$)")
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"tokenizer directory '{path}': cannot load a tokenizer ({msg}); set dump.text.tokenizer") from None
    finally:
        hf_logging.set_verbosity(level)


def _stream(tokenizer, docs: Sequence[str], cfg: TextConfig) -> np.ndarray:
    enc = tokenizer(list(docs), add_special_tokens=False)["input_ids"] if docs else []
    bos = tokenizer.bos_token_id if cfg.add_bos else None
    eos = tokenizer.eos_token_id if cfg.add_eos else None
    parts = []
    for ids in enc:
        if bos is not None:
            parts.append([bos])
        parts.append(ids)
        if eos is not None:
            parts.append([eos])
    flat = [t for p in parts for t in p]
    return np.asarray(flat, dtype=np.int64)


def pack(stream: np.ndarray, seq_len: int, n: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Windows of ``seq_len + 1`` tokens, stride ``seq_len``: (tokens [batch, seq], targets [batch, seq]).

    Every token of the stream but the first is a target exactly once (trailing partial window dropped).
    """
    m = max(0, (len(stream) - 1) // seq_len)
    if n is not None:
        m = min(m, n)
    idx = np.arange(m)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    win = stream[idx] if m else np.zeros((0, seq_len + 1), dtype=np.int64)
    return win[:, :-1].copy(), win[:, 1:].copy()


def check_split_counts(cfg: TextConfig, asked: Mapping[str, int], got: Mapping[str, int]) -> None:
    """Refuse (or warn, ``dump.text.short_splits``) when a split gets fewer sequences than ``dump.sequences`` asks,
    before anything is written (the dump stage's summary line reports got/asked per split either way).

    Raises:
        InputError: a split is short and ``short_splits`` is ``refuse``.
    """
    import sys

    short = [s for s in got if got[s] < int(asked[s])]
    if not short:
        return
    what = ", ".join(f"'{s}' gets {got[s]} of the {int(asked[s])} asked" for s in short)
    if cfg.short_splits == "refuse":
        raise InputError(f"dump.text.path '{cfg.path}': split {what} (dump.sequences); use a longer corpus or fewer "
                         "dump.sequences, or set dump.text.short_splits: warn to dump what there is")
    print(f"warning: dump.text.path '{cfg.path}': split {what} (dump.sequences); dumping what there is "
          "(dump.text.short_splits: warn)", file=sys.stderr, flush=True)


def text_batch(tokenizer, docs: Sequence[str], cfg: TextConfig, n: int | None = None,
               vocab_size: int | None = None, stream: np.ndarray | None = None) -> TaskBatch:
    """Pack one split's documents into a :class:`TaskBatch` (difficulty −1: filled after the dump).

    Args:
        tokenizer: the checkpoint's tokenizer.
        docs: the split's documents, in order.
        cfg: the ``dump.text`` section.
        n: at most this many sequences.
        vocab_size: the model's logit width; every target must be below it.
        stream: ``docs`` already tokenised and framed (:func:`_stream`), to tokenise a split once.
    """
    tokens, targets = pack(_stream(tokenizer, docs, cfg) if stream is None else stream, cfg.seq_len, n)
    if vocab_size is not None and targets.size and int(max(tokens.max(), targets.max())) >= vocab_size:
        raise InputError(f"tokenizer produces id {int(max(tokens.max(), targets.max()))} but the model reads out "
                         f"{vocab_size} classes; dump.text.tokenizer does not match the checkpoint")
    which = tokens if cfg.token_type_of == "input" else targets
    table = token_type_table(tokenizer, which)
    lut = np.vectorize(table.__getitem__, otypes=[np.int64])
    token_type = lut(which) if which.size else np.zeros_like(which)
    return TaskBatch(tokens=tokens, targets=targets, difficulty=np.full_like(tokens, -1), token_type=token_type)


def text_splits(cfg: TextConfig, sequences: Mapping[str, int], tokenizer_path: Path | str,
                vocab_size: int | None = None, trust_remote_code: bool = False) -> dict[str, TaskBatch]:
    """Every split of ``sequences`` (split → at most that many sequences) from the corpus of ``cfg``
    (``trust_remote_code``: :func:`load_tokenizer`'s); :func:`text_dataset` without the difficulty attributes."""
    return text_dataset(cfg, sequences, tokenizer_path, vocab_size, trust_remote_code)[0]


def text_dataset(cfg: TextConfig, sequences: Mapping[str, int], tokenizer_path: Path | str,
                 vocab_size: int | None = None, trust_remote_code: bool = False
                 ) -> tuple[dict[str, TaskBatch], dict[str, Any]]:
    """The splits of ``sequences`` from the corpus of ``cfg``, with ``difficulty`` filled for ``token_frequency``.

    Returns:
        (split -> :class:`TaskBatch`, the difficulty's store attributes: ``difficulty_name``,
        ``difficulty_definition`` and, for ``token_frequency``, ``difficulty_edges`` (nats) and
        ``difficulty_counts`` {n_tokens N, vocab_size V}; for ``final_loss`` the edges come at the finaliser).

    Raises:
        ValueError: a split gets no full window, or the fit split has no token to count (names the file, split
        and the fix).
    """
    docs = read_documents(cfg.path, cfg.format, cfg.field, cfg.max_documents)
    tok = load_tokenizer(cfg.tokenizer or tokenizer_path, trust_remote_code)
    by_split: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for d in docs:
        by_split[document_split(d)].append(d)
    streams: dict[str, np.ndarray] = {}  # each split tokenised once (fit also feeds the frequency counts)

    def stream(split: str) -> np.ndarray:
        if split not in streams:
            streams[split] = _stream(tok, by_split[SPLITS.index(split)], cfg)
        return streams[split]

    out = {}
    for split, n in sequences.items():
        batch = text_batch(tok, by_split[SPLITS.index(split)], cfg, int(n), vocab_size, stream(split))
        if len(batch) == 0:
            raise InputError(f"dump.text.path '{cfg.path}': split '{split}' gets {len(by_split[SPLITS.index(split)])} "
                             f"documents, not one window of {cfg.seq_len + 1} tokens; use a longer corpus or a "
                             "smaller dump.text.seq_len")
        out[split] = batch
    check_split_counts(cfg, sequences, {s: len(b) for s, b in out.items()})
    attrs: dict[str, Any] = {"difficulty_name": DIFFICULTY_NAMES[cfg.difficulty],
                             "difficulty_definition": DIFFICULTY_DEFINITIONS[cfg.difficulty]}
    if cfg.difficulty == "token_frequency":
        fit_targets = stream("fit")[1:]  # every target of the fit stream
        if fit_targets.size == 0:
            raise InputError(f"dump.text.path '{cfg.path}': the fit split has no token to count frequencies on; "
                             "use a longer corpus or dump.text.difficulty: final_loss")
        V = int(vocab_size) if vocab_size is not None else max(len(tok), int(fit_targets.max()) + 1)
        surprisal = unigram_surprisal(fit_targets, V)
        _, edges = loss_bins(surprisal[fit_targets], cfg.difficulty_bins)
        out = {s: TaskBatch(b.tokens, b.targets, surprisal_bins(b.targets, surprisal, edges), b.token_type)
               for s, b in out.items()}
        attrs.update(difficulty_edges=edges.tolist(),
                     difficulty_counts={"n_tokens": int(fit_targets.size), "vocab_size": V})
    if cfg.dedup_prefixes:
        out, _ = dedup_prefixes(out)
    return out, attrs


def dedup_prefixes(batches: Mapping[str, TaskBatch]) -> tuple[dict[str, TaskBatch], dict]:
    """Exact-duplicate-prefix removal across splits: every scored window prefix ends up scored in one split only.

    A prefix (``tokens[b, :pos+1]``, compared by its 128-bit key, :func:`looptrace.tasks.base.prefix_keys`) that is
    scored in several splits is kept in one of them — ``owners[h mod len(owners)]``, ``owners`` the splits it is
    scored in (in ``SPLITS`` order), ``h`` the first 64 bits of its key: a function of the prefix and of which
    splits hold it, not of row order — and unscored elsewhere (``targets = IGNORE``, difficulty and token type −1;
    the row stays, so ``sequence`` keeps indexing the packed windows). Prefixes scored in one split only are
    untouched, so repeats *within* a split stay (they are not a leak between splits).

    Returns:
        (new batches, report): ``report = {"unscored": {split: n tokens}, "before": shared_prefixes(...)}``.
    """
    order = [s for s in SPLITS if s in batches] + [s for s in batches if s not in SPLITS]
    keys = {s: prefix_keys(batches[s].tokens) for s in order}
    scored = {s: batches[s].targets != IGNORE for s in order}
    report: dict = {"unscored": {s: 0 for s in order},
                    "before": shared_prefixes({s: keys[s][scored[s]] for s in order})}
    uniq = {s: np.unique(keys[s][scored[s]]) for s in order}
    allk, cnt = np.unique(np.concatenate([uniq[s] for s in order]), return_counts=True)
    multi = allk[cnt > 1]
    if not len(multi):
        return dict(batches), report
    present = np.stack([np.isin(multi, uniq[s]) for s in order])  # [split, key]
    pick = (multi["h0"] % present.sum(0).astype(np.uint64)).astype(np.int64)  # index among the owners
    owner = present & (np.cumsum(present, axis=0) - 1 == pick[None, :])
    out = {}
    for j, s in enumerate(order):
        b = batches[s]
        lose = multi[present[j] & ~owner[j]]
        drop = scored[s] & np.isin(keys[s], lose)
        report["unscored"][s] = int(drop.sum())
        out[s] = TaskBatch(b.tokens, np.where(drop, IGNORE, b.targets), np.where(drop, -1, b.difficulty),
                           np.where(drop, -1, b.token_type))
    return out, report


# ---------------------------------------------------------------------------------------------
# Difficulty after the forward pass
# ---------------------------------------------------------------------------------------------

def unigram_surprisal(targets: np.ndarray, vocab_size: int) -> np.ndarray:
    """Add-one smoothed unigram surprisal of every token id: u(y) = log((N + V) / (c(y) + 1)) nats, [vocab].

    Args:
        targets: [N] the token ids counted (the fit split's stream targets).
        vocab_size: V; every id must be below it.
    """
    t = np.asarray(targets, dtype=np.int64).ravel()
    c = np.bincount(t, minlength=int(vocab_size)).astype(np.float64)
    if c.size > vocab_size:
        raise InputError(f"token id {int(t.max())} ≥ the vocabulary size {vocab_size}; dump.text.tokenizer does not "
                         "match the checkpoint")
    return np.log((t.size + vocab_size) / (c + 1.0))


def surprisal_bins(targets: np.ndarray, surprisal: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Bin of each scored target's surprisal under the fit edges (``loss_bins``' rule); −1 where unscored.

    Args:
        targets: [batch, seq] target ids (``IGNORE`` = unscored).
        surprisal: [vocab] :func:`unigram_surprisal`.
        edges: [bins − 1] ascending.
    """
    tg = np.asarray(targets)
    ok = tg != IGNORE
    u = surprisal[np.where(ok, tg, 0)]
    return np.where(ok, np.searchsorted(edges, u, side="left"), -1).astype(np.int64)


def loss_bins(loss: np.ndarray, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Bin of each loss among all of them: (bins [token] int64 in 0..n_bins−1, edges [n_bins−1]).

    Edges are the empirical quantiles k / n_bins (k = 1..n_bins−1, numpy's linear rule) of the finite
    losses; a loss goes to the number of edges strictly below it (equal losses share a bin). NaN → −1.
    """
    loss = np.asarray(loss, dtype=np.float64)
    ok = np.isfinite(loss)
    if not ok.any() or n_bins == 1:
        return np.where(ok, 0, -1).astype(np.int64), np.zeros(0)
    edges = np.quantile(loss[ok], np.arange(1, n_bins) / n_bins)
    bins = np.searchsorted(edges, loss, side="left").astype(np.int64)
    bins[~ok] = -1
    return bins, edges


def loss_bins_finalizer(n_bins: int):
    """``dump_split(finalize=...)`` hook: rewrite ``difficulty`` as the bin of ℓ_T = −target_logprob[:, T−1].

    Returns:
        A callable ``(writer) -> attrs`` (records ``difficulty_edges``, nats).
    """

    def finalize(writer) -> dict[str, Any]:
        T = int(writer.attrs["n_loops"])
        loss = -writer.read("target_logprob")[:, T - 1].astype(np.float64)
        bins, edges = loss_bins(loss, n_bins)
        writer.rewrite("difficulty", bins)
        return {"difficulty_edges": edges.tolist()}

    return finalize


def text_attrs(cfg: TextConfig, split: str) -> dict[str, Any]:
    """Store attributes of a text split (task description, difficulty name and definition, token-type names)."""

    return {"split": split, "task": {"name": "text", "kind": "text", **to_dict(cfg)},
            "difficulty_name": DIFFICULTY_NAMES[cfg.difficulty],
            "difficulty_definition": DIFFICULTY_DEFINITIONS[cfg.difficulty],
            "difficulty_levels": list(range(cfg.difficulty_bins)), "token_types": list(TOKEN_TYPES)}


__all__ = ["DIFFICULTY_DEFINITIONS", "DIFFICULTY_NAMES", "FUNCTION_WORDS", "TOKEN_TYPES", "TextConfig",
           "classify_token_text", "dedup_prefixes", "document_split", "load_tokenizer", "loss_bins",
           "loss_bins_finalizer", "pack", "read_documents", "surprisal_bins", "text_attrs", "text_batch",
           "text_dataset", "text_splits", "token_type_table", "unigram_surprisal"]
