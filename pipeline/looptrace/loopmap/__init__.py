"""The loop map h_t = f(h_{t−1}) of a looped model (SPEC §2b): ``config`` (``LoopmapConfig``, the ``loopmap``
section), ``contraction`` (ρ_t and the FTLE through the loop step; also the dump's opt-in ``dump.contraction``),
``interventions`` (noise and patching at a loop, re-run after it), ``measure`` (a sample through the model),
``diagnoses`` (regime, certified exit, failure AUCs; torch-free), ``tracing`` (cross-loop causal tracing and
exit-gate patching: clean state patched into a corrupted run), ``trace_tables`` (their tables and the answer-flip
depth; torch-free), ``tabulate`` (the stage's tables; torch-free),
``plots`` (the stage's figures), ``stage`` (the loopmap stage's library) and ``diagnose_rows`` (the loop map in the
diagnose stage's outputs)."""
