"""DVC stage ``train`` (dvc.yaml): runs ``looptrace.stages.train.main``, the entry ``looptrace train`` runs too."""

from looptrace.errors import run
from looptrace.stages.train import main

if __name__ == "__main__":
    run(main)
