"""DVC stage ``diagnose`` (dvc.yaml): runs ``looptrace.stages.diagnose.main``, the entry ``looptrace diagnose`` runs too."""

from looptrace.errors import run
from looptrace.stages.diagnose import main

if __name__ == "__main__":
    run(main)
