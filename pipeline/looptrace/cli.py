"""The ``looptrace`` Typer app: one command per DVC stage.

Each command is the ``main`` function of ``looptrace.stages.<name>``, the same entry DVC runs (through the
launcher ``stages/<name>.py``), so the CLI and ``dvc repro`` execute exactly the same code; the commands are the
stages the entries registered (:func:`looptrace.stages.registered`). Errors a user can fix
(bad params, missing or invalid inputs) print one line and exit with status 2.
"""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from looptrace.errors import launch
from looptrace.models.adapters.kinds import KINDS as ADAPTERS
from looptrace.models.regimes import KINDS as REGIMES
from looptrace.project import defined_names
from looptrace.rules.builtin import OURO_Q_EXIT_RULES
from looptrace.rules.registry import ENTRY_POINT_GROUP, builtin_rules
from looptrace.stages import registered
from looptrace.tasks import KINDS as TASKS

#: What the app says about itself (``looptrace --help``): for a user, not a developer.
HELP = ("looptrace: find out why adaptive depth in a looped (recurrent-depth) transformer works or fails.\n\n"
        "Each command is one stage of the DVC pipeline (dvc.yaml): `dvc repro` runs them all in order, "
        "`looptrace <stage> --help` says what one reads and writes. Hyper-parameters live in params.yaml "
        "(override one with `dvc exp run -S section.key=value`); every array, metric, exit rule and failure class "
        "is defined in docs/SPEC.md.\n\n"
        "When the run is done, open artifacts/report/index.html (its headline tables are explained on the page); "
        "artifacts/report/summary.md holds the same findings as text.")


def rule_line(rule) -> str:
    """One exit rule in words, from its registry entry (kind, signals, op, first loop, two-hit)."""
    if rule.description:
        return f"{rule.name}: {rule.description}"
    if rule.kind == "oracle":
        return f"{rule.name}: ceiling — the first loop whose prediction is right (reads the target; offline only)"
    if rule.kind == "fixed":
        return f"{rule.name}: exit at loop k for every token (thresholds 1..T)"
    op = "≤" if rule.op == "le" else "≥"
    what = " / ".join(rule.signals)
    extra = [f"from loop {rule.min_loop}"] if rule.min_loop > 1 else []
    if rule.two_hit:
        extra.append("two loops in a row")
    return f"{rule.name}: exit when {what} {op} threshold" + (f" ({', '.join(extra)})" if extra else "")


def _names_in_params(path: str = "params.yaml") -> list[str]:
    """What ./params.yaml defines: task and regime names and the model names of its matrix; [] when there is no
    readable file (help must print regardless)."""

    try:
        names = defined_names([path])
    except Exception:  # noqa: BLE001 - help must print even over a broken or absent params file
        return []
    out = [f"{what} in ./{path}: {', '.join(names[key])}." for key, what in
           (("tasks", "Tasks (--task)"), ("regimes", "Regimes (--regime)")) if names[key]]
    models = names["models"]
    shown = ", ".join(models[:6]) + (f", … ({len(models)} in all)" if len(models) > 6 else "")
    out.append(f"Models in ./{path} (train.tasks × train.regimes × train.seeds): {shown}.")
    return out


def vocabulary(*blocks: str) -> str:
    """The epilog of a help page: the valid names of ``blocks`` (tasks, regimes, models, rules, adapters),
    listed from the code's own registries so they cannot go stale. Paragraphs: Typer joins single lines."""

    out = []
    for b in blocks:
        if b == "tasks":
            out.append("Task kinds (train.task_defs.<name>.kind): " + ", ".join(TASKS) + ".")
        elif b == "regimes":
            out.append("Regime kinds (train.regime_defs.<name>.kind): " + ", ".join(REGIMES) + ".")
        elif b == "models":
            out.append("A model is named <task>-<regime>-s<seed> after train.task_defs, train.regime_defs and "
                       "train.seeds (e.g. running_parity-uniform-s0).")
            out += _names_in_params()
        elif b == "rules":
            out.append("Exit rules (readouts.rules, latency.rules, generate.rules), built in:")
            out += [f"  {rule_line(r)}" for r in (*builtin_rules().values(), *OURO_Q_EXIT_RULES.values())]
            out.append(f"Your own rule: 'package.module:function' (decorated with looptrace.rules.exit_rule) or an "
                       f"entry point in the '{ENTRY_POINT_GROUP}' group; docs/pipeline.md 'Your own exit rule'.")
        elif b == "adapters":
            out.append("Checkpoint adapters (dump.adapter.kind, a local directory only): " + ", ".join(ADAPTERS.names())
                       + ".")
        else:
            raise ValueError(f"unknown help block {b!r}")
    return "\n\n".join(out)


def _listing(base: type, blocks: tuple[str, ...]) -> type:
    """A Typer command / group class whose epilog is :func:`vocabulary` of ``blocks``, built when the help is
    shown (so the models of ./params.yaml are those of the directory the user is in, not of the import)."""

    class WithVocabulary(base):
        def format_help(self, ctx, formatter) -> None:
            self.epilog = vocabulary(*blocks)
            super().format_help(ctx, formatter)

    return WithVocabulary


class _Program(typer.Typer):
    """The app run as the ``looptrace`` program: through :func:`looptrace.errors.launch`, so that its exit status
    says whether a Ctrl-C or SIGTERM came before or after the stage committed its output (as ``stages/<name>.py``
    does). Called with ``standalone_mode=False`` (a caller that handles the outcome itself) it is the plain app."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("standalone_mode", True) is False:
            return super().__call__(*args, **kwargs)
        launch(lambda: super(_Program, self).__call__(*args, **kwargs), "looptrace")


app = _Program(name="looptrace", help=HELP, cls=_listing(TyperGroup, ("tasks", "regimes", "models", "rules",
                                                                           "adapters")),
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)


@app.callback()
def _root() -> None:
    """looptrace: trajectory diagnostics for adaptive depth in looped transformers."""


#: Every stage in pipeline order, as its entry registered it (looptrace.stages.register_stage): one command each,
#: whose help is its main's docstring plus the names of its help blocks.
STAGES = registered()
for _stage in STAGES:
    app.command(_stage.name, help=(_stage.main.__doc__ or "").strip(),
                cls=_listing(TyperCommand, _stage.help_blocks))(_stage.main)
