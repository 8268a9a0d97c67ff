"""Failure localisation and the trajectory-vs-readout verdict (the ``diagnose`` stage, SPEC §7).

For every model × rule at its chosen operating point (readouts' rules and, when present, the offline
gates'), each test token falls in exactly one class:

- ``correct``: the exit loop's prediction is right;
- ``trajectory``: no loop 1..T is right (the oracle fails too);
- ``readout_early``: some loop is right, the rule exited before the first right loop;
- ``readout_overthinking``: the rule exited after a right loop, at a wrong one.

Verdict per model ([AD]'s decision aid, made explicit). Every figure is a val-chosen point on test with its
95 % interval (bootstrap over test sequences; across seeds the Student-t interval on the logit scale of [1, T],
:func:`group_verdicts`). Each comparison is the difference of two figures with an interval
(:class:`looptrace.estimates.Difference`: per model from the two bootstrap intervals, per task × regime the
paired per-seed differences): a gap counts only when that interval excludes 0 *and* the estimate is at least
``gap_tol`` loops; the absence of a gap counts only when the interval rules out one of ``gap_tol``. A verdict
is one of the three outcomes only when the comparisons it rests on are decided; otherwise it is
**undecided** (overlapping intervals are not evidence for either side), with the comparison it
waits on and, per task × regime, the seeds that would decide at the observed spread. Depths are chosen-point
test depths, so every rule is compared at accuracy within δ of full depth (defined even when D@95 is not).

1. ``best`` = the post-hoc readout or refit gate chosen on *val* (lowest val depth among chosen points within δ,
   :func:`looptrace.rules.scoring.best_chosen`), ``fixed`` = fixed depth's chosen point, ``oracle`` = the
   earliest-correct ceiling (mean first right loop), ``native`` = the native gate.
2. ``best`` not lower than ``fixed`` by ``gap_tol`` (ruled out by the interval) → **trajectory-limited**: no rule reading the trajectory — post-hoc
   readouts and gates refit on it with every feature — exits earlier than fixed depth beyond noise, so the exit
   information is not decodable from the trajectory ([AD]'s decision aid: refit gates test the trajectory).
   Reason ``no_headroom`` when even the oracle ceiling is not lower than fixed depth (right answers arrive
   only at full depth), ``no_early_exit`` otherwise (the oracle's earlier right answers — on binary tasks partly
   chance hits — are not recognisable from the state).
3. the native gate higher than ``best`` → **readout-limited** (``native_gate``): the trajectory supports early
   exit, the model's own gate does not use it.
4. ``best`` higher than the oracle ceiling → **readout-limited** (``below_ceiling``): right answers come earlier
   than any readout finds them.
5. ``best`` not higher than the oracle by ``gap_tol`` (ruled out by the interval) and the native gate, if any,
   not higher than ``best`` by ``gap_tol`` → **at-ceiling** (``at_ceiling``): ``best`` exits earlier than
   fixed depth and at (or below) the oracle ceiling — the readout already gets everything this trajectory offers, so neither a better
   readout nor, on this evidence, the trajectory is the limit at this accuracy; only a trajectory that is right
   earlier would lower the depth. (It is not called trajectory-limited, which would read as a
   contradiction beside 0 % trajectory failures.)
6. otherwise **undecided**: ``undecided_early_exit`` (step 2 neither decided for nor against an early exit),
   ``undecided_ceiling`` (step 4/5: at or below the ceiling not decided), ``undecided_native`` (at the ceiling
   but the native gate may be worse by ``gap_tol``).

Each verdict's sentence cites the figures with their intervals, the comparisons it rests on, and the error
counts at the best rule's point (trajectory vs readout failures); :func:`check_verdict` recomputes the
comparisons from the row's own numbers and the stage refuses a row that contradicts them.

The summary checks [AD]'s three findings on our models from the numbers (never tuned), per task × regime on
the across-seed intervals (:func:`ad_claims`): (a) on fixed-prior (uniform / geometric) trajectories confidence
readouts reach a lower D@X than fixed depth; (b) the native joint gate's frontier is worse than post-hoc
readouts on fixed-prior trajectories of the same task; (c) gates refit on frozen fixed-prior trajectories are
strong, on jointly trained ones weak. A claim holds on a group only when the intervals support it.

The package, statistics apart from prose: ``config`` (``DiagnoseConfig``), ``stats`` (failure classes, Spearman,
:func:`decide`, :func:`dx_best`: numbers only), ``words`` (figures as text, verdict sentences, :func:`check_verdict`),
``verdicts`` (the verdict rows), ``claims`` (:func:`ad_claims`), ``summary`` (summary.md); the stage's functions
(:func:`diagnose_models`, :func:`model_rows`, :func:`write_diagnosis`) are here.
"""

# The stage's code is in looptrace/diagnose/stage.py (as looptrace/gates/stage.py): importing one of this package's
# modules (the loopmap stage reads loopmap/diagnoses.py) then loads that module, not the whole diagnose stage.
