"""DVC stage ``latency`` (dvc.yaml): runs ``looptrace.stages.latency.main``, the entry ``looptrace latency`` runs too."""

from looptrace.errors import run
from looptrace.stages.latency import main

if __name__ == "__main__":
    run(main)
