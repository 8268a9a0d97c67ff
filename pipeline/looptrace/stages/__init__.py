"""The stages' entries and their registry: each module ``looptrace.stages.<name>`` is one DVC stage (dvc.yaml stage =
``stages/<name>.py`` launcher = params section = ``artifacts/<name>/``) and registers itself with
:func:`register_stage` on its Typer ``main``.

An entry holds its registration and its CLI ``main`` (options; load config, claim the output, open inputs, call its
library once, print a summary); the computation and the section's config dataclass live in the stage's library, the
module named by ``library=``, in the concern package of what it computes (docs/DESIGN.md, "Where a stage's code
lives"). Everything that lists the stages derives from this registry (:data:`STAGES`, a
:class:`looptrace.registry.Registry` whose entries are the entry modules, each registering its stage when imported):
the CLI's commands (:mod:`looptrace.cli`),
the params sections (:data:`looptrace.config.SECTIONS`, from the entries' file names, so that loading params imports
no entry), the kill harness (tests/test_kill_anywhere.py) and DESIGN.md's stage table (tests/test_stages.py).

This package's ``__init__`` is torch-free and imports no entry: :func:`registered` imports them all (torch included).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from looptrace.config import STAGE_NAMES
from looptrace.io.interrupts import guarded
from looptrace.registry import Registry

#: The help blocks a stage's ``--help`` may list (``looptrace.cli.vocabulary``).
HELP_BLOCKS = ("tasks", "regimes", "models", "rules", "adapters")


@dataclass(frozen=True)
class Stage:
    """One stage, as its entry registered it.

    Attributes:
        name: the stage's one name (dvc.yaml stage, launcher, params section, ``artifacts/<name>/``, CLI command).
        order: its place in the pipeline (CLI listing, the stage table); a stage comes after those it reads.
        main: the Typer command (its docstring is the command's help), wrapped as the stage's body
            (:func:`looptrace.io.interrupts.guarded`: where Ctrl-C or SIGTERM may stop it).
        config: the section's config dataclass.
        library: the module holding the stage's computation (what ``main`` calls).
        help_blocks: the valid names its ``--help`` lists (:data:`HELP_BLOCKS`).
    """

    name: str
    order: int
    main: Callable
    config: type
    library: str
    help_blocks: tuple[str, ...] = ("models",)


#: name -> its :class:`Stage`: each entry module ``looptrace.stages.<name>`` (named by its file, :data:`STAGE_NAMES`)
#: registers its stage when imported.
STAGES: Registry[Stage] = Registry("stage", {name: f"{__name__}.{name}" for name in STAGE_NAMES})


def register_stage(name: str, order: int, *, config: type, library: str,
                   help_blocks: tuple[str, ...] = ("models",)) -> Callable[[Callable], Callable]:
    """Decorator of an entry's ``main``: registers the stage ``name`` (which must be the entry's module name).

    Raises:
        ValueError: the name is not the module's, or is registered twice, or a help block is unknown.
    """
    def deco(main: Callable) -> Callable:
        module = main.__module__
        if module != f"{__name__}.{name}":
            raise ValueError(f"stage {name!r} must be registered by {__name__}.{name}, not {module}")
        old = STAGES.entry(name)
        if isinstance(old, Stage) and getattr(old.main, "__wrapped__", None) is not main:
            raise ValueError(f"stage {name!r} is registered twice")
        unknown = [b for b in help_blocks if b not in HELP_BLOCKS]
        if unknown:
            raise ValueError(f"stage {name!r}: unknown help blocks {unknown}; known: {', '.join(HELP_BLOCKS)}")
        # The body a signal may stop (looptrace.io.interrupts): the module's ``main`` is this wrapper, so the
        # launcher stages/<name>.py and the CLI run the same one.
        body = old.main if isinstance(old, Stage) else guarded(name, main)
        STAGES.add(name, Stage(name, order, body, config, library, tuple(help_blocks)), module=module)
        return body

    return deco


def registered() -> tuple[Stage, ...]:
    """Every stage, in pipeline order: imports each entry ``looptrace.stages.<name>`` (torch included).

    Raises:
        looptrace.registry.RegistryError: an entry registers no stage (decorate its main with @register_stage).
    """
    return tuple(sorted(STAGES.values(), key=lambda s: (s.order, s.name)))
