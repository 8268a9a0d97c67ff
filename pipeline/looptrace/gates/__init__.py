"""Halting gates fit on frozen trajectories (the ``gates`` stage, SPEC §6, [AD]).

Backbone and readout head stay frozen. A new gate maps the features of a token at loop t to
P(stop | features_t); the exit rule is SPEC §4's "offline gate", d = min{t : P(stop) ≥ γ} (d = T when
never met). Fit on the ``fit`` split, calibrate γ on ``val`` (the 51-quantile grid of readouts),
report on ``test`` — scored by exactly the operating-point code of ``looptrace.rules.scoring``.

Features per (token, loop), all from the trajectory store (read block by block):

- h_t (``hidden``), optionally PCA-reduced (scikit-learn ``PCA`` fit on fit-split states only);
- optional scalar statistics (``gates.stats``): the store's logit statistics (entropy, max_prob,
  margin, kl_prev, kl_prev_rev, logit_change, gate_logit) and the step geometry of SPEC §2 (step_norm,
  rel_step, step_cos, state_cos_dist, accel, accel_norm, step_d2, hidden_change) computed with
  ``looptrace.signals.steps.step_metrics`` — the function the geometry stage uses, so the values are those of
  ``token_loop.parquet``. Non-negative statistics enter as log(max(x, 1e-10)) (``gates.log_stats``:
  they span decades, e.g. KL 1e-6…1); statistics that need t − 1 are NaN at t = 1 and, after
  standardising, set to 0 (= the fit mean) — the loop encoding tells the gate which loop it is at;
- the loop index, one-hot over the T loops by default (``gates.loop_feature``): a linear gate then
  has one bias per loop, i.e. it can learn a depth prior as the PonderNet objective needs; ``scalar``
  (t / T) and ``none`` are the alternatives.

The continuous part (h or its PCA components, statistics, scalar loop) is standardised with a
scikit-learn ``StandardScaler`` fit on the fit split only. Statistics that use the target
(``target_logprob``) or loop T's readout (``kl_final``) are refused: the gate must be computable at
loop t.

Gates (``gates.gates``, names ``<gate>-<labels>``; rule ``gate:<gate>-<labels>``):

- ``logreg-*``: ``sklearn.linear_model.LogisticRegression``; ``mlp-*``:
  ``sklearn.neural_network.MLPClassifier``, on the label schemes of SPEC §6:
  ``oracle`` (RecurTrace): continue_t = 1[min_{t'>t} ℓ_{t'} < ℓ_t − δ];
  ``consistent`` (CALM): stop_t = 1[argmax_t = argmax_T];
  ``utility`` (Ouro stage II): I_t = max(0, ℓ_{t−1} − ℓ_t), soft continue target
  c_t = σ(k(I_t − γ)), k = 50, γ = 0.005. Soft targets are fit with the classifiers by a
  sample-weighted binary fit: each row appears once as "stop" with weight 1 − c_t and once as
  "continue" with weight c_t, whose weighted log-loss is exactly the soft-target cross-entropy.
  Ouro pairs the decision at loop t with I_t (the improvement loop t itself brought; defined for
  t ≥ 2): ``gates.utility_align: ouro``; ``next`` pairs it with I_{t+1}, the improvement the next
  loop would bring (defined for t ≤ T − 1).
  P(stop) = 1 − P(continue) for utility and oracle, P(stop) for consistent.
- ``ponder-linear`` / ``ponder-mlp``: a small torch module g (linear, or a 2-layer MLP) trained on the
  frozen per-depth losses ℓ_t = −target_logprob to minimise Σ_t q_t ℓ_t + β KL(q ‖ π) with
  λ_t = σ(g(x_t)) and q = ``looptrace.signals.halting_torch.halting_distribution`` (SPEC §5, [AD]'s "same objective");
  P(stop) = λ_t.

Training rows are loops 1..T − 1 (the exit at T is forced whatever the gate says; the PonderNet
objective uses all T loops, q_T taking the remaining mass), and the threshold grid is the quantiles of
val P(stop) at loops 1..T − 1 — the values that can move an exit. Training tokens are a seeded
subsample of the fit split (``gates.max_fit_tokens``). Every random choice derives from ``base.seed``
(and the model and gate names), so the same params give the same numbers.

Cross-regime transfer (``cross_regime.parquet``): for every task, each gate of ``gates.cross_gates``
fit on one model's trajectories is applied to every model of the same task (itself included):
``transfer`` = the fitted gate (features, scaler, classifier) applied as is to the eval model's
trajectories; ``refit`` = the same gate spec refit on the eval model's own fit split (that is, the eval
model's own gate, repeated on each row so every (fit, eval) pair carries its baseline). Both are
calibrated on the eval model's val split and reported on its test split.
"""
