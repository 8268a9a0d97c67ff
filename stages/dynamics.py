"""DVC stage ``dynamics`` (dvc.yaml): runs ``looptrace.stages.dynamics.main``, the entry ``looptrace dynamics`` runs too."""

from looptrace.errors import run
from looptrace.stages.dynamics import main

if __name__ == "__main__":
    run(main)
