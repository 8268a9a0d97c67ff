"""DVC stage ``geometry`` (dvc.yaml): runs ``looptrace.stages.geometry.main``, the entry ``looptrace geometry`` runs too."""

from looptrace.errors import run
from looptrace.stages.geometry import main

if __name__ == "__main__":
    run(main)
