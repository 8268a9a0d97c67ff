"""Text corpora → TaskBatch, token types, loss-bin difficulty, and the LM profile end to end.

The end-to-end test runs the repository's LM profile (params.yaml + profiles/lm/params.yaml, paths pointed at a tiny Dory checkpoint and
corpus built here) through ``looptrace dump`` → ``geometry`` → ``readouts`` → ``diagnose`` with the CLI, and
checks the store against the model's own forward pass (independent of the adapter and the dump).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter

import numpy as np
import polars as pl
import pytest
import torch
import yaml

from looptrace.tasks.text import (
    TOKEN_TYPES,
    TextConfig,
    classify_token_text,
    dedup_prefixes,
    document_split,
    loss_bins,
    pack,
    read_documents,
    surprisal_bins,
    text_batch,
    unigram_surprisal,
)
from tests import hf_helpers as H
from tests.hf_helpers import corpus, lm_params

torch.set_num_threads(1)
T_ = {name: i for i, name in enumerate(TOKEN_TYPES)}


@pytest.mark.parametrize("text, kind", [
    (" ", "whitespace"), ("\n\n", "whitespace"), ("", "whitespace"), (",", "punctuation"), (" ...", "punctuation"),
    ("$", "punctuation"), (" 42", "number"), ("3.14", "number"), ("2,718", "number"), (" the", "function_word"),
    ("The", "function_word"), (" of", "function_word"), ("n't", "function_word"), (" cat", "content_word"),
    ("ing", "content_word"), ("Über", "content_word"), ("x2", "content_word"), ("\ufffd", "other"),
])
def test_token_types_of_hand_picked_strings(text, kind):
    assert TOKEN_TYPES[classify_token_text(text)] == kind


def test_special_tokens_and_tokenizer_table():
    assert TOKEN_TYPES[classify_token_text("</s>", special=True)] == "special"
    tok = H.tokenizer()
    cfg = TextConfig(path="unused", seq_len=6, add_bos=True, add_eos=True)
    b = text_batch(tok, ["The cat sat on the mat, 42 times."], cfg)
    ids = tok("The cat sat on the mat, 42 times.", add_special_tokens=False)["input_ids"]
    stream = [tok.bos_token_id, *ids, tok.eos_token_id]
    n = (len(stream) - 1) // 6
    np.testing.assert_array_equal(b.tokens.ravel(), stream[: 6 * n])
    np.testing.assert_array_equal(b.targets.ravel(), stream[1: 6 * n + 1])
    assert (b.difficulty == -1).all()
    want = [classify_token_text(tok.decode([i]), special=i in tok.all_special_ids) for i in b.tokens.ravel()]
    np.testing.assert_array_equal(b.token_type.ravel(), want)
    assert b.token_type.ravel()[0] == T_["special"]  # <s>
    with pytest.raises(ValueError, match="model reads out 10 classes"):
        text_batch(tok, ["The cat sat on the mat."], cfg, vocab_size=10)


def test_pack_windows_score_every_next_token_once():
    s = np.arange(20)
    tokens, targets = pack(s, 6)
    np.testing.assert_array_equal(tokens, [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17]])
    np.testing.assert_array_equal(targets, tokens + 1)
    assert pack(s, 6, n=2)[0].shape == (2, 6)
    assert pack(np.arange(5), 6)[0].shape == (0, 6)


def test_read_documents_formats_and_errors(tmp_path):
    docs = ["one doc", "two\ndocs", "three"]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)) + "\n\n")
    assert read_documents(tmp_path / "c.jsonl") == docs
    assert read_documents(tmp_path / "c.jsonl", max_documents=2) == docs[:2]
    pl.DataFrame({"body": docs}).write_parquet(tmp_path / "c.parquet")
    assert read_documents(tmp_path / "c.parquet", field="body") == docs
    (tmp_path / "c.txt").write_text("one doc\n\ntwo\ndocs\n  \nthree\n")
    assert read_documents(tmp_path / "c.txt") == docs
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_documents(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="no string field 'content'"):
        read_documents(tmp_path / "c.jsonl", field="content")
    with pytest.raises(ValueError, match="cannot read column 'text'"):
        read_documents(tmp_path / "c.parquet")
    with pytest.raises(ValueError, match="not found"):
        read_documents(tmp_path / "none.jsonl")


def test_document_splits_are_disjoint_and_content_defined():
    docs = [f"document number {i}" for i in range(300)]
    s = np.array([document_split(d) for d in docs])
    assert set(s) == {0, 1, 2} and all(np.bincount(s) > 70)
    assert [document_split(d) for d in docs] == list(s)  # a function of the text only


def test_dedup_prefixes_hand_case():
    """Window prefixes scored in several splits end up scored in exactly one (by hand: (5) is in all three
    splits, (5, 6) in fit and val; everything else is unique)."""
    from looptrace.tasks import IGNORE, TaskBatch
    from looptrace.tasks.base import prefix_keys, shared_prefixes

    def batch(rows):
        t = np.array(rows)
        return TaskBatch(t, t + 1, np.zeros_like(t), np.zeros_like(t))

    data = {"fit": batch([[5, 6, 7], [1, 2, 3]]), "val": batch([[5, 6, 8]]), "test": batch([[5, 9, 7], [1, 4, 4]])}
    # (1) is in fit and test too
    out, rep = dedup_prefixes(data)
    keys = {s: prefix_keys(b.tokens)[b.targets != IGNORE] for s, b in out.items()}
    assert shared_prefixes(keys)["shared_any"] == {"fit": 0, "val": 0, "test": 0}
    assert rep["before"]["shared_any"] == {"fit": 3, "val": 2, "test": 2}
    assert sum(rep["unscored"].values()) == 2 + 1 + 1  # (5): 2 of 3 copies; (5, 6): 1 of 2; (1): 1 of 2
    # each shared prefix is kept in the split its hash picks among the splits holding it; the rest is untouched
    h5 = int(prefix_keys(np.array([[5]]))["h0"][0, 0])
    owner5 = ["fit", "val", "test"][h5 % 3]
    for s, b in out.items():
        assert (b.targets[0, 0] != IGNORE) == (s == owner5)
    assert out["fit"].targets[0, 2] == 8 and out["val"].targets[0, 2] == 9 and out["test"].targets[0, 1:].tolist() == [10, 8]
    np.testing.assert_array_equal(out["test"].tokens, data["test"].tokens)  # rows and inputs stay
    assert (out["fit"].difficulty[out["fit"].targets == IGNORE] == -1).all()
    again, rep2 = dedup_prefixes(out)  # idempotent
    assert sum(rep2["unscored"].values()) == 0


def test_unigram_surprisal_hand_case():
    # N = 6 targets over V = 4 ids: counts (3, 2, 1, 0) -> u = log(10 / (c + 1))
    u = unigram_surprisal(np.array([0, 0, 0, 1, 1, 2]), 4)
    np.testing.assert_allclose(u, np.log(10 / np.array([4.0, 3.0, 2.0, 1.0])))
    assert u[3] > u[2] > u[1] > u[0]  # rarer is harder; an id never seen in fit gets the largest value
    edges = np.array([u[1]])  # two bins: {0, 1} easy, {2, 3} hard
    np.testing.assert_array_equal(surprisal_bins(np.array([[0, 1, 2, -100, 3]]), u, edges), [[0, 0, 1, -1, 1]])
    with pytest.raises(ValueError, match="vocabulary size 2"):
        unigram_surprisal(np.array([0, 5]), 2)


def test_text_difficulty_config():
    from looptrace.config import ConfigError

    assert TextConfig(path="x").difficulty == "token_frequency"
    with pytest.raises(ConfigError, match="dump.text.difficulty must be token_frequency or final_loss"):
        TextConfig(path="x", difficulty="loss")


def test_loss_bins_hand_case():
    loss = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, np.nan])
    bins, edges = loss_bins(loss, 2)
    np.testing.assert_allclose(edges, [0.55])
    np.testing.assert_array_equal(bins, [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, -1])
    bins, edges = loss_bins(np.array([1.0, 1.0, 1.0, 2.0]), 4)  # ties share a bin
    np.testing.assert_array_equal(bins, [0, 0, 0, 3])


# ----------------------------------------------------------------------------- end to end


def test_lm_profile_end_to_end_against_the_models_own_forward(tmp_path):
    from transformers import DoryForCausalLM
    from typer.testing import CliRunner

    from looptrace.cli import app
    from looptrace.io.store.reader import open_store
    from looptrace.tasks.text import text_splits

    ckpt = H.build_dory(tmp_path / "dory")
    params = lm_params(tmp_path, ckpt, corpus(tmp_path / "corpus.jsonl"))
    art = tmp_path / "artifacts"
    run = CliRunner().invoke
    r = run(app, ["dump", "--params", str(params), "--out", str(art / "dump")])
    assert r.exit_code == 0, r.output

    model = DoryForCausalLM.from_pretrained(ckpt, local_files_only=True).eval()
    tcfg = TextConfig(path=str(tmp_path / "corpus.jsonl"), seq_len=16)
    data = text_splits(tcfg, {"fit": 4, "val": 4, "test": 4}, ckpt, H.VOCAB)
    n_scored = {s: int((b.targets != -100).sum()) for s, b in data.items()}
    # 4 windows of 16 per split; window prefixes shared across splits are scored in one split only
    assert sum(n_scored.values()) < 3 * 64 and min(n_scored.values()) > 48
    assert (f"tiny: dumped tokens per split: fit {n_scored['fit']}, val {n_scored['val']}, "
            f"test {n_scored['test']} (T = 3)") in r.output
    assert f"test tokens with a prefix scored in fit/val: 0 of {n_scored['test']}" in r.output
    raw = text_splits(dataclasses.replace(tcfg, dedup_prefixes=False), {"fit": 4, "val": 4, "test": 4}, ckpt, H.VOCAB)
    assert all((b.targets != -100).all() for b in raw.values())
    tok = H.tokenizer()
    fit_docs = [d for d in read_documents(tmp_path / "corpus.jsonl") if document_split(d) == 0]
    fit_stream = [t for d in fit_docs for t in (tok.bos_token_id, *tok(d, add_special_tokens=False)["input_ids"],
                                                tok.eos_token_id)]
    counts, n_fit = Counter(fit_stream[1:]), len(fit_stream) - 1
    assert n_fit > 4 * 16  # counted on every fit document, not only the 4 dumped windows
    fit_u = np.array([math.log((n_fit + H.VOCAB) / (counts[y] + 1)) for y in fit_stream[1:]])
    fit_edges = np.quantile(fit_u, np.arange(1, 10) / 10)
    for split in ("fit", "val", "test"):
        st = open_store(art / "dump" / "tiny" / f"{split}.zarr")
        a = st.attrs
        assert (a["split"], a["task"]["kind"], a["difficulty_name"], a["logits_mode"]) == (
            split, "text", "unigram_surprisal_bin", "topk")  # vocab 300 > full_logits_max_vocab 256
        assert a["dtypes"]["hidden"] == "float16" and a["token_types"] == list(TOKEN_TYPES)
        assert a["prefix_overlap"]["shared_any"] == 0 and a["prefix_overlap"]["n_scored"] == n_scored[split]
        b = data[split]
        m = (b.targets != -100).ravel()
        np.testing.assert_array_equal(st.read("token_id"), b.tokens.ravel()[m])
        np.testing.assert_array_equal(st.read("target"), b.targets.ravel()[m])
        with torch.no_grad():
            out = model(torch.from_numpy(b.tokens), output_hidden_states=True)
        logp = torch.log_softmax(out.logits.float(), -1).reshape(-1, H.VOCAB).numpy()[m]
        tgt = b.targets.ravel()[m]
        ref_lp = logp[np.arange(len(tgt)), tgt]
        np.testing.assert_allclose(st.read("target_logprob")[:, -1], ref_lp, rtol=1e-5, atol=1e-5)
        # states after each loop = the model's own hidden states (float16 storage)
        for t in range(3):
            ref_h = out.hidden_states[1 + 2 * (t + 1)].reshape(-1, 32).numpy()[m]
            np.testing.assert_allclose(st.read("hidden")[:, t], ref_h, rtol=2e-3, atol=2e-3)
        # top-k of the last loop = top-k of the model's logits
        z = out.logits.reshape(-1, H.VOCAB)[torch.from_numpy(m)]
        np.testing.assert_array_equal(st.read("topk_ids")[:, -1], z.topk(16, -1).indices.numpy())
        # difficulty = decile of the target's unigram surprisal counted on the fit split's token stream, with fit
        # edges (independent: counted here with a Counter over the fit documents, tokenised again)
        u = np.array([math.log((n_fit + H.VOCAB) / (counts[y] + 1)) for y in tgt])
        np.testing.assert_array_equal(st.read("difficulty"), [int((fit_edges < x).sum()) for x in u])
        assert a["difficulty_edges"] == pytest.approx(fit_edges.tolist(), abs=1e-12)
        assert a["difficulty_counts"] == {"n_tokens": n_fit, "vocab_size": H.VOCAB}
        assert "independent of the model" in a["difficulty_definition"]
        types = [classify_token_text(tok.decode([i]), special=i in tok.all_special_ids) for i in st.read("token_id")]
        np.testing.assert_array_equal(st.read("token_type"), types)

    # the downstream stages run unchanged on the LM stores
    for cmd in (["geometry", "--model", "tiny", "--dump-root", str(art / "dump"), "--out", str(art / "geometry")],
                ["readouts", "--model", "tiny", "--geometry-root", str(art / "geometry"), "--out",
                 str(art / "readouts")],
                ["diagnose", "--models", "tiny", "--readouts-root", str(art / "readouts"), "--gates-root",
                 str(art / "gates"), "--geometry-root", str(art / "geometry"), "--out", str(art / "diagnose")]):
        r = run(app, [*cmd, "--params", str(params)])
        assert r.exit_code == 0, (cmd[0], r.output)
    tl = pl.read_parquet(art / "geometry" / "tiny" / "token_loop.parquet")
    assert tl.height == sum(n_scored.values()) * 3 and set(tl["loop"].unique()) == {1, 2, 3}
    ops = pl.read_parquet(art / "readouts" / "tiny" / "operating_points.parquet")
    assert {"entropy", "kl_prev", "fixed", "oracle"} <= set(ops["rule"].unique())
    assert "q_exit" not in set(ops["rule"].unique())  # Dory has no native gate
    assert (art / "diagnose" / "summary.md").is_file()

    # the rest of the LM recipe (profiles/lm/dvc.yaml): gates -> generate -> report on the same artifacts
    p = yaml.safe_load(params.read_text())
    p["generate"].update(prompts=3, prompt_len=4, new_tokens=3, batch_sizes=[1, 3], repeats=1)
    params.write_text(yaml.safe_dump(p, sort_keys=False))
    for cmd in (["gates", "--models", "tiny", "--dump-root", str(art / "dump"), "--out", str(art / "gates")],
                ["generate", "--dump-root", str(art / "dump"), "--readouts-root", str(art / "readouts"),
                 "--gates-root", str(art / "gates"), "--out", str(art / "generate")],
                ["report", "--models", "tiny", "--root", str(art), "--out", str(art / "report")]):
        r = run(app, [*cmd, "--params", str(params)])
        assert r.exit_code == 0, (cmd[0], r.output)
    gen = pl.read_parquet(art / "generate" / "generate.parquet")
    chosen = pl.read_parquet(art / "readouts" / "tiny" / "chosen.parquet")
    want = {r: t for r, t in zip(chosen["rule"], chosen["threshold"], strict=True) if r in ("top1", "entropy", "kl_prev")}
    assert {r: t for r, t in zip(gen["rule"], gen["threshold"], strict=True) if not r.startswith("gate")} == want
    assert set(gen["policy"]) == {"share", "recompute"} and set(gen["batch_size"]) == {1, 3}
    assert (gen["n_loops"] == 3).all() and (gen["n_tokens"] == 9).all()
    skipped = json.loads((art / "generate" / "metrics.json").read_text())["models"]["tiny"]["skipped"]
    assert "q_exit" in skipped and "native" in skipped["policy:native"]  # no gate; Dory's per_loop cache
    # the prompts are the corpus's windows, checked against the store (whose de-duplicated positions are absent)
    from looptrace.online.generate import load_prompts

    store = art / "dump" / "tiny" / "test.zarr"
    assert open_store(store).n_tokens < 4 * 16
    with pytest.raises(ValueError, match="changed since the dump"):
        load_prompts(store, 3, 4, lambda: np.zeros((4, 16), np.int64))
    with pytest.raises(ValueError, match="need the corpus"):
        load_prompts(store, 3, 4)
    page = (art / "report" / "index.html").read_text()
    assert "<h2>Generation with early exit</h2>" in page and page.count("<td>tiny</td><td>top1</td>") == 2
    rep = json.loads((art / "report" / "metrics.json").read_text())
    assert set(rep["generate"]) == {"share_bs1", "share_bs3", "recompute_bs1", "recompute_bs3"}
    assert rep["models"]["tiny"]["full_depth_accuracy"] is not None

    # resume: a second dump finds the complete stores and writes nothing
    before = {p: p.stat().st_mtime_ns for p in (art / "dump" / "tiny").rglob("*") if p.is_file()}
    r = run(app, ["dump", "--params", str(params), "--out", str(art / "dump")])
    assert r.exit_code == 0, r.output
    assert before == {p: p.stat().st_mtime_ns for p in (art / "dump" / "tiny").rglob("*") if p.is_file()}

    # without the prefix de-duplication the test split shares window prefixes with fit/val: refused in one line,
    # before anything is written, unless dump.allow_prefix_overlap
    p = yaml.safe_load(params.read_text())
    p["dump"]["text"]["dedup_prefixes"] = False
    params.write_text(yaml.safe_dump(p, sort_keys=False))
    r = run(app, ["dump", "--params", str(params), "--out", str(art / "dump_raw")])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "split 'test' has" in r.output and "dump.allow_prefix_overlap: true" in r.output
    assert not (art / "dump_raw" / "tiny" / "test.zarr").exists()
    p["dump"]["allow_prefix_overlap"] = True
    params.write_text(yaml.safe_dump(p, sort_keys=False))
    r = run(app, ["dump", "--params", str(params), "--out", str(art / "dump_raw")])
    assert r.exit_code == 0, r.output
    a = open_store(art / "dump_raw" / "tiny" / "test.zarr").attrs["prefix_overlap"]
    assert a["allowed"] and a["shared_any"] > 0 and a["n_scored"] == 64


def test_final_loss_difficulty_is_the_models_own_loss_decile(tmp_path):
    """``text.difficulty: final_loss``: the column is rewritten after the forward from the stored loss at loop T
    (independent: the model's own forward, numpy quantiles within the split)."""
    from transformers import DoryForCausalLM
    from typer.testing import CliRunner

    from looptrace.cli import app
    from looptrace.io.store.reader import open_store
    from looptrace.tasks.text import text_splits

    ckpt = H.build_dory(tmp_path / "dory")
    params = lm_params(tmp_path, ckpt, corpus(tmp_path / "corpus.jsonl"))
    p = yaml.safe_load(params.read_text())
    p["dump"]["text"]["difficulty"] = "final_loss"
    p["dump"]["sequences"] = {"test": 4}
    params.write_text(yaml.safe_dump(p, sort_keys=False))
    r = CliRunner().invoke(app, ["dump", "--params", str(params), "--out", str(tmp_path / "dump")])
    assert r.exit_code == 0, r.output
    st = open_store(tmp_path / "dump" / "tiny" / "test.zarr")
    assert st.attrs["difficulty_name"] == "final_loss_bin" and "depends on the model" in st.attrs["difficulty_definition"]
    b = text_splits(TextConfig(path=str(tmp_path / "corpus.jsonl"), seq_len=16), {"test": 4}, ckpt, H.VOCAB)["test"]
    m = (b.targets != -100).ravel()
    model = DoryForCausalLM.from_pretrained(ckpt, local_files_only=True).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.from_numpy(b.tokens)).logits.float(), -1).reshape(-1, H.VOCAB).numpy()[m]
    tgt = b.targets.ravel()[m]
    loss = -logp[np.arange(len(tgt)), tgt].astype(np.float64)
    edges = np.quantile(loss, np.arange(1, 10) / 10)
    np.testing.assert_array_equal(st.read("difficulty"), [int((edges < x).sum()) for x in loss])
    assert np.allclose(st.attrs["difficulty_edges"], edges, rtol=1e-4)


def test_lm_stage_errors_are_one_line(tmp_path):
    from typer.testing import CliRunner

    from looptrace.cli import app

    params = lm_params(tmp_path, tmp_path / "nope", tmp_path / "none.jsonl")
    r = CliRunner().invoke(app, ["dump", "--params", str(params), "--out", str(tmp_path / "a")])
    assert r.exit_code == 2 and "dump.adapter.path" in r.output and "is not a directory" in r.output
    p = yaml.safe_load(params.read_text())
    p["dump"]["adapter"]["kind"] = "lstm"
    params.write_text(yaml.safe_dump(p, sort_keys=False))
    r = CliRunner().invoke(app, ["dump", "--params", str(params)])
    assert r.exit_code == 2 and "dump.adapter.kind must be one of" in r.output
