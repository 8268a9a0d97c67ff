"""Capture: run a looped model once and persist its trajectories (``dump``) and its training checkpoints'
probe trajectories (``dynamics``). The only analysis-side package that imports model code."""
