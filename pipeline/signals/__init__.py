"""Per-loop signals, each defined once: logit signals (SPEC §3), step signals (SPEC §2), halting signals."""
