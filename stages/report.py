"""DVC stage ``report`` (dvc.yaml): runs ``looptrace.stages.report.main``, the entry ``looptrace report`` runs too."""

from looptrace.errors import run
from looptrace.stages.report import main

if __name__ == "__main__":
    run(main)
