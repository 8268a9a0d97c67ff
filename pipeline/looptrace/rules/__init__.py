"""Exit rules (SPEC §4) and the operating-point protocol that scores them (calibration, Pareto, D@X).

Public API of a user's own rule (see :mod:`looptrace.rules.base`)::

    from looptrace.rules import exit_rule

    @exit_rule(signals=("max_prob", "argmax"), op="ge", min_loop=2)
    def my_rule(s): ...           # {signal: [token, loop]} -> [token, loop] score

then ``readouts.rules: [..., mypkg.rules:my_rule]`` (and ``latency.rules``), or a ``looptrace.rules`` entry point.
"""

from looptrace.rules import calm as _calm  # noqa: F401 - registers CALM's rule (``calm``)
from looptrace.rules import certified as _certified  # noqa: F401 - registers ``certified_fixed_point``, ``estimated_fixed_point``
from looptrace.rules.base import ExitRule, exit_rule
from looptrace.rules.registry import get_rule, register

__all__ = ["ExitRule", "exit_rule", "get_rule", "register"]
