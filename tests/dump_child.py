"""A dump in a child process for the multi-process tests: ``python tests/dump_child.py '<json>'``.

JSON keys: ``path`` (store path or URL), ``shard`` ([i, N], default [0, 1]), ``n_seq`` (default 60),
``delay`` (seconds added around every chunk write, so a kill lands mid-range), ``cfg`` (DumpConfig overrides
of :func:`tests.builders.tiny_dump_config`), ``hold`` (seconds to sleep after the first chunk written, so
the writer stays live mid-range until killed). Prints ``ready``, then ``wrote <chunk>`` after every chunk,
then ``done <complete>``; a refusal prints ``error: <one line>`` and exits 2.
"""

import json
import sys
import time

import torch

torch.set_num_threads(1)

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))  # the repository: tests.builders

from looptrace.capture.dump import dump_split  # noqa: E402
from looptrace.io.store.writer import StoreWriter  # noqa: E402
from tests.builders import tiny_adapter_and_data, tiny_dump_config  # noqa: E402

args = json.loads(sys.argv[1])
delay = float(args.get("delay", 0.0))
hold = [float(args.get("hold", 0.0))]
real = StoreWriter.write_chunk


def slow(self, c, a, **kw):
    time.sleep(delay / 2)
    out = real(self, c, a, **kw)
    print(f"wrote {c}", flush=True)
    time.sleep(delay / 2 + hold.pop() if hold else delay / 2)
    return out


StoreWriter.write_chunk = slow
adapter, data = tiny_adapter_and_data(n_seq=int(args.get("n_seq", 60)))
print("ready", flush=True)
try:
    st = dump_split(adapter, data, args["path"], tiny_dump_config(**args.get("cfg", {})), progress=False,
                    shard=tuple(args.get("shard", (0, 1))))
except ValueError as exc:  # StoreError, ClaimError: the one-line user errors
    print(f"error: {str(exc).splitlines()[0]}", flush=True)
    sys.exit(2)
print(f"done {st.complete}", flush=True)
