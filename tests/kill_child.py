"""One stage command in a child process for the kill harness: ``python tests/kill_child.py '<json>'``.

JSON keys: ``cwd`` (the project root to run in), ``argv`` (the ``looptrace`` command line, e.g. ``["geometry",
"--model", "m"]``). Imports everything a stage needs, prints ``ready``, then runs the command exactly as the CLI
does (exit code and all), so the parent's SIGKILL after ``ready`` lands in the stage's work, not in imports.

Everything runs under the ``__main__`` guard: a stage that spawns worker processes (train's pool) re-imports this
file in each of them as ``__mp_main__``, which must not run the command again.
"""

import json
import os
import sys

if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)

    import importlib

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

    from looptrace.cli import app
    from tests.test_kill_anywhere import PRELOAD

    for mod in PRELOAD:
        importlib.import_module(mod)

    args = json.loads(sys.argv[1])
    os.chdir(args["cwd"])
    print("ready", flush=True)
    app(args=list(args["argv"]), prog_name="looptrace")  # through looptrace.errors.launch, as the program
