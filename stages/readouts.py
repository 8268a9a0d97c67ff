"""DVC stage ``readouts`` (dvc.yaml): runs ``looptrace.stages.readouts.main``, the entry ``looptrace readouts`` runs too."""

from looptrace.errors import run
from looptrace.stages.readouts import main

if __name__ == "__main__":
    run(main)
