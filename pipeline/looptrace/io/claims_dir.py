"""The claims directory of an output (:mod:`looptrace.io.claims` is the protocol that uses it): its records —
owners (:class:`Owner`, :func:`is_live`), plans (:class:`Plan`), shard and finaliser claims — each created only if it
does not exist, in the sibling ``.<name>.claims/`` (:func:`claims_location`, :class:`ClaimsDir`); the shard ranges of
N cooperating writers (:func:`shard_range`, :func:`parse_shard`, :func:`shard_from_env`); and :class:`ClaimError`,
every refusal of the protocol."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from looptrace.config import UserError

#: Default lease of a claim held by a process on another host: without a heartbeat for this long, it is dead.
LEASE_S = 600.0

#: Kinds of plans (what the plan's creator does before setting ``ready``).
PLAN_KINDS = ("layout", "resume", "repair", "tidy")

_NAME = re.compile(r"^(?P<base>[A-Za-z0-9_.-]+)@(?P<gen>\d+)\.json$")
_URL = re.compile(r"^(?P<proto>[A-Za-z][A-Za-z0-9+.-]+)://(?P<rest>.*)$")


class ClaimError(UserError, ValueError):
    """A one-line refusal: the output is being written by another live process, the shard plans differ, or
    this process's claim was taken over."""


# ---------------------------------------------------------------------------------------------
# Owners and liveness
# ---------------------------------------------------------------------------------------------

def _proc_start(pid: int) -> float | None:
    """The start time of a running process ``pid``; None when there is none (a zombie — exited, not yet reaped, as
    a killed stage's pool workers are where nothing reaps orphans — writes nothing and counts as gone)."""
    try:
        import psutil

        proc = psutil.Process(pid)
        if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return None
        return float(proc.create_time())
    except Exception:  # noqa: BLE001 - no such process (or no permission): treated as gone
        return None


def this_host() -> str:
    """Host name recorded in claims (``LOOPTRACE_HOST`` overrides it, e.g. containers sharing a hostname)."""
    return os.environ.get("LOOPTRACE_HOST") or socket.gethostname()


@dataclass(frozen=True)
class Owner:
    """Who holds a claim: a process on a host, identified by pid and the pid's start time (pid reuse)."""

    id: str
    host: str
    pid: int
    pid_start: float | None
    started: float

    @classmethod
    def me(cls) -> Owner:
        pid = os.getpid()
        return cls(uuid.uuid4().hex[:12], this_host(), pid, _proc_start(pid), time.time())

    @classmethod
    def from_record(cls, rec: dict) -> Owner:
        o = rec.get("owner") or {}
        return cls(str(o.get("id", "?")), str(o.get("host", "?")), int(o.get("pid", -1)), o.get("pid_start"),
                   float(o.get("started", 0.0)))

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on host {self.host} (started {when})"


#: Ids of this process's coordinators that still hold claims (a record of this pid with another id is left
#: over from a finished one, e.g. one that could not mark it released because the disk was full).
ACTIVE_OWNERS: set[str] = set()


def is_live(rec: dict | None, lease_s: float, now: float | None = None) -> TypeGuard[dict]:
    """Whether a record's owner still works on it.

    A record is live while its ``state`` is ``active`` and its owner lives: on this host, the pid exists with
    the recorded start time (and, in this very process, its coordinator has not finished); on another host,
    its last heartbeat is younger than ``lease_s`` seconds.
    """
    if not rec or rec.get("state") != "active":
        return False
    owner = Owner.from_record(rec)
    if owner.host == this_host():
        if owner.pid == os.getpid():
            return owner.id in ACTIVE_OWNERS
        start = _proc_start(owner.pid)
        if start is None:
            return False
        return owner.pid_start is None or abs(start - float(owner.pid_start)) < 0.5
    now = time.time() if now is None else now
    return now - float(rec.get("heartbeat", 0.0)) < lease_s


# ---------------------------------------------------------------------------------------------
# The claims directory: list, read, create-exclusive, owner-only overwrite
# ---------------------------------------------------------------------------------------------

def claims_location(target: str) -> str:
    """Claims directory of an output path or URL: the sibling ``.<name>.claims``."""
    s = str(target).rstrip("/")
    m = _URL.match(s)
    if m:
        head, sep, name = s.rpartition("/")
        if not sep or head.endswith(":/") or head.endswith("://") or "/" not in m["rest"]:
            raise ClaimError(f"{target}: an output at the root of a bucket has no place for its claims; "
                             "use a path inside the bucket")
        return f"{head}/.{name}.claims"
    p = Path(s)
    return str(p.parent / f".{p.name}.claims")


class ClaimsDir:
    """The objects of one claims directory (local directory or fsspec URL)."""

    def __init__(self, location: str):
        self.location = location
        m = _URL.match(location)
        self.local = m is None or m["proto"] in ("file", "local")
        if self.local:
            self.root = location if m is None else m["rest"]
            self.fs: Any = None  # an fsspec filesystem (untyped) when not local
        else:
            assert m is not None  # not local: a URL
            import fsspec

            opts: dict[str, Any] = {}
            if m["proto"] not in ("memory",):
                # our own synchronous instance, no listings cache: a long-lived process must see every claim
                opts = {"use_listings_cache": False, "skip_instance_cache": True}
            self.fs, self.root = fsspec.url_to_fs(location, **opts)
            self.root = self.root.rstrip("/")

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def names(self) -> list[str]:
        """Record names present (``<base>@<gen>.json``), in no particular order."""
        if self.local:
            try:
                return [n for n in os.listdir(self.root) if _NAME.match(n)]
            except (FileNotFoundError, NotADirectoryError):
                return []
        try:
            found = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        out = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in found]
        return [n for n in out if _NAME.match(n)]

    def read(self, name: str) -> dict | None:
        try:
            if self.local:
                with open(self._path(name), "rb") as f:
                    raw = f.read()
            else:
                raw = self.fs.cat_file(self._path(name))
        except FileNotFoundError:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return {"state": "released", "corrupt": True}  # a torn record cannot be live

    def create(self, name: str, rec: dict) -> bool:
        """Create ``name`` holding ``rec`` iff it does not exist (atomic). True = created by us."""
        data = json.dumps(rec, sort_keys=True).encode()
        if self.local:
            for _ in range(100):  # a finaliser may remove the (empty) directory between makedirs and mkstemp
                os.makedirs(self.root, exist_ok=True)
                try:
                    fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
                    break
                except FileNotFoundError:
                    continue
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.link(tmp, self._path(name))
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        try:
            self.fs.pipe_file(self._path(name), data, mode="create")
            return True
        except FileExistsError:
            return False
        except Exception as exc:  # noqa: BLE001 - a backend that has no conditional create: say so
            if "PreconditionFailed" in repr(exc) or "412" in str(exc):
                return False
            raise

    def overwrite(self, name: str, rec: dict) -> None:
        """Replace a record this process owns (heartbeat, state); atomic per object.

        A record that is gone is not recreated: the finaliser retired its whole plan (the output is complete).
        """
        data = json.dumps(rec, sort_keys=True).encode()
        if self.local:
            if not os.path.exists(self._path(name)):
                return
            try:
                fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
            except FileNotFoundError:
                return
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self._path(name))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        elif self.fs.exists(self._path(name)):
            self.fs.pipe_file(self._path(name), data)

    def remove(self, names: list[str]) -> None:
        for n in names:
            with contextlib.suppress(FileNotFoundError):
                if self.local:
                    os.unlink(self._path(n))
                else:
                    self.fs.rm_file(self._path(n))

    def remove_if_empty(self) -> None:
        """Remove the directory once no record is left (local: also stray temp files of killed writers)."""
        if not self.local:
            return  # object stores have no directories
        try:
            left = os.listdir(self.root)
        except FileNotFoundError:
            return
        if any(_NAME.match(n) for n in left):
            return
        for n in left:  # `.tmp-*` of a process killed mid-write (a live one's exists for microseconds)
            with contextlib.suppress(OSError):
                if time.time() - os.path.getmtime(self._path(n)) > 60:
                    os.unlink(self._path(n))
        with contextlib.suppress(OSError):
            os.rmdir(self.root)

    def exists(self) -> bool:
        if self.local:
            return os.path.isdir(self.root)
        return bool(self.names())


def parse_record_name(name: str) -> tuple[str, int] | None:
    m = _NAME.match(name)
    return (m["base"], int(m["gen"])) if m else None


# ---------------------------------------------------------------------------------------------
# The protocol
# ---------------------------------------------------------------------------------------------

@dataclass
class Plan:
    """The current plan of an output (``plan@<k>``) and what lies under it."""

    gen: int
    rec: dict
    live: list[dict]  # live records under it (plan record included while its creator works on it)

    @property
    def fingerprint(self) -> str:
        return str(self.rec.get("fingerprint"))

    @property
    def n_shards(self) -> int:
        return int(self.rec.get("n_shards", 1))

    @property
    def kind(self) -> str:
        return str(self.rec.get("kind"))

    @property
    def ready(self) -> bool:
        return bool(self.rec.get("ready"))

    @property
    def active(self) -> bool:
        return bool(self.live)


def shard_range(n_chunks: int, i: int, n: int) -> range:
    """Chunks of shard ``i`` of ``n``: contiguous, disjoint, covering and whole chunks by construction."""
    if not (n >= 1 and 0 <= i < n):
        raise ClaimError(f"shard {i}/{n}: need 0 <= i < n")
    return range(i * n_chunks // n, (i + 1) * n_chunks // n)


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/N"`` -> ``(i, N)`` (``--shard``), with a one-line error for anything else."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if not m or not (int(m[2]) >= 1 and int(m[1]) < int(m[2])):
        raise ClaimError(f"--shard {text!r}: expected i/N with 0 <= i < N (e.g. 0/2)")
    return int(m[1]), int(m[2])


def shard_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(RANK, WORLD_SIZE)`` from the environment (torchrun, SLURM wrappers, by hand), else ``(0, 1)``."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" not in env and "RANK" not in env:
        return 0, 1
    try:
        i, n = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ClaimError(f"RANK={env.get('RANK')!r} / WORLD_SIZE={env.get('WORLD_SIZE')!r}: expected integers") from None
    if not (n >= 1 and 0 <= i < n):
        raise ClaimError(f"RANK={i} / WORLD_SIZE={n}: need 0 <= RANK < WORLD_SIZE")
    return i, n
