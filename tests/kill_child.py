"""One stage command in a child process for the kill harness: ``python tests/kill_child.py '<json>'``.

JSON keys: ``cwd`` (the project root to run in), ``argv`` (the ``looptrace`` command line, e.g. ``["geometry",
"--model", "m"]``). Imports everything a stage needs, prints ``ready``, then runs the command exactly as the CLI
does (exit code and all), so the parent's SIGKILL after ``ready`` lands in the stage's work, not in imports.
"""

import json
import os
import sys

import torch

torch.set_num_threads(1)

import importlib  # noqa: E402

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

from looptrace.cli import app  # noqa: E402
from tests.test_kill_anywhere import PRELOAD  # noqa: E402

for mod in PRELOAD:
    importlib.import_module(mod)

args = json.loads(sys.argv[1])
os.chdir(args["cwd"])
print("ready", flush=True)
app(args=list(args["argv"]), prog_name="looptrace")  # through looptrace.errors.launch, as the program
