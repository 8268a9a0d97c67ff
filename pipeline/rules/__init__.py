"""Exit rules (SPEC §4) and the operating-point protocol that scores them (calibration, Pareto, D@X)."""
