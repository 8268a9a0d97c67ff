"""Model names with a seed axis: parsing, grouping, the default matrix (looptrace.project)."""

from __future__ import annotations

from looptrace.project import model_name, model_names, resolve_model, seed_groups, split_seed


def test_split_seed_round_trips_model_name():
    for t, r, s in [("running_parity", "uniform", 0), ("rs", "fixed-prior", 12), ("a-b", "c", None)]:
        assert split_seed(model_name(t, r, s)) == (f"{t}-{r}", s)
    assert split_seed("ouro-s") == ("ouro-s", None)  # "-s" without digits is part of the name
    assert split_seed("huginn-sX1") == ("huginn-sX1", None)


def test_seed_axis_in_the_default_matrix_and_groups():
    params = {"train": {"tasks": ["a", "b"], "regimes": ["x"], "seeds": [0, 3]}}
    names = model_names(params)
    assert names == ["a-x-s0", "a-x-s3", "b-x-s0", "b-x-s3"]
    assert seed_groups(names) == {"a-x": ["a-x-s0", "a-x-s3"], "b-x": ["b-x-s0", "b-x-s3"]}
    assert model_names({"train": {"tasks": ["a"], "regimes": ["x"]}}) == ["a-x"]


def test_resolve_model_with_and_without_seed():
    tasks, regimes = {"rp": {}}, {"fixed": {"kind": "fixed"}}
    got = resolve_model("rp-fixed-s1", tasks, regimes)
    assert (got["group"], got["seed"], got["task"], got["regime"], got["regime_kind"]) == \
        ("rp-fixed", 1, "rp", "fixed", "fixed")
    got = resolve_model("rp-fixed", tasks, regimes)
    assert (got["group"], got["seed"], got["task"]) == ("rp-fixed", None, "rp")
    assert resolve_model("ouro", tasks, regimes)["task"] is None
