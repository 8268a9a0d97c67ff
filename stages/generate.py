"""DVC stage ``generate`` (dvc.yaml): runs ``looptrace.stages.generate.main``, the entry ``looptrace generate`` runs too."""

from looptrace.errors import run
from looptrace.stages.generate import main

if __name__ == "__main__":
    run(main)
