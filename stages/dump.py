"""DVC stage ``dump`` (dvc.yaml): runs ``looptrace.stages.dump.main``, the entry ``looptrace dump`` runs too."""

from looptrace.errors import run
from looptrace.stages.dump import main

if __name__ == "__main__":
    run(main)
