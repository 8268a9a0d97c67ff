"""An exception raised inside a user's own exit rule is the user's bug: one line naming their function,
where in it it failed, and the signals' shape (tokens × loops 1..t) it was called on — not "a bug in looptrace"."""

from __future__ import annotations

import os
import traceback

from looptrace.config import UserError


class UserRuleError(UserError, RuntimeError):
    """A user's exit rule raised: the message names the function, its file and line, and the call's shape."""


def user_rule_error(rule, exc: BaseException, shape: tuple[int, ...]) -> UserRuleError:
    """The one-line error of ``rule.score`` raising ``exc`` on signals of ``shape`` ([token, loop])."""
    fn = rule.score
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    src = getattr(getattr(fn, "__code__", None), "co_filename", None)
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if src and os.path.samefile(f.filename, src)] if src and os.path.exists(src) else []
    at = f" at {mine[-1].filename}:{mine[-1].lineno}" if mine else ""
    n, t = (shape + (0, 0))[:2]
    msg = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
    return UserRuleError(f"your exit rule '{rule.name}' ({name}{at}) raised {type(exc).__name__}"
                         f"{': ' + msg if msg else ''} on signals of shape ({n} tokens, loops 1..{t}); the error is in "
                         "the rule's own function, not in looptrace: fix it or drop it from the rules list")


__all__ = ["UserRuleError", "user_rule_error"]
