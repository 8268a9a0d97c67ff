"""DVC stage ``gates`` (dvc.yaml): runs ``looptrace.stages.gates.main``, the entry ``looptrace gates`` runs too."""

from looptrace.errors import run
from looptrace.stages.gates import main

if __name__ == "__main__":
    run(main)
