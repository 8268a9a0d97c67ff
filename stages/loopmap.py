"""DVC stage ``loopmap`` (dvc.yaml): runs ``looptrace.stages.loopmap.main``, the entry ``looptrace loopmap`` runs too."""

from looptrace.errors import run
from looptrace.stages.loopmap import main

if __name__ == "__main__":
    run(main)
