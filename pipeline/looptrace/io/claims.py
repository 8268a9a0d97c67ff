"""Claims: one design for "one writer per output" and for N cooperating writers of one store.

Every writer of an output (a trajectory store, or any stage's output directory) first takes a **claim** in
the output's *claims directory*, a sibling ``.<name>.claims/`` of the output (``s3://b/dump/m/.val.zarr.claims/``
for ``s3://b/dump/m/val.zarr``). The output itself never holds a coordination object, so a finished store is
pure data and its consolidated metadata never lists one. The only storage primitive needed is an atomic
*create this object only if it does not exist*:

- local directories: write a temp file, then ``os.link(tmp, name)`` (``FileExistsError`` when taken; the
  content appears whole or not at all);
- fsspec filesystems: ``pipe_file(name, data, mode="create")``: on S3 a ``PutObject`` with
  ``If-None-Match: *`` (HTTP 412 when taken; AWS since 2024-08 and moto 5), on ``memory://`` a dict insert.
  (zarr's own ``FsspecStore.set_if_not_exists`` is exists-then-set, not atomic, so it is not used.)

Records (JSON objects, one per file; the owner is ``{id, host, pid, pid_start, started}``):

- ``plan@<k>.json`` — generation ``k`` of the output's *plan*: the fingerprint of the inputs, the number of
  shards ``n`` and what its creator does before it is ``ready`` (``layout``: create the store; ``resume``:
  nothing; ``repair``: reopen a complete store; ``tidy``: remove debris). The current plan is the newest one
  that is not ``withdrawn``. A plan is created only when the current one is inactive (no live record under
  it), so two partitions of one store, or two runs with different inputs, never write at the same time.
- ``p<k>.shard<i>of<n>@<g>.json`` — generation ``g`` of the claim of shard ``i`` of plan ``k``: its owner
  writes the chunks of that shard's range and nothing else. A dead claim (same host: the pid is gone or was
  reused; other host: no heartbeat for ``lease_s``) is taken over by creating generation ``g + 1``; exactly
  one contender wins. ``state`` is ``active``, ``done`` (range written and verified) or ``released``.
- ``p<k>.final@<g>.json`` — the finaliser of plan ``k`` (exactly one process marks the store complete).

Race-freedom of a new plan (the only step that needs more than one create): a joiner creates its shard claim
*then* checks that no newer plan exists; a planner creates ``plan@k+1`` *then* checks that nothing under the
older plans is live. On a linearizable store (local filesystems, S3, memory) at least one of the two sees the
other: the planner withdraws its plan and looks again (it joins a compatible live plan, and is refused naming
the other writer by an incompatible one), or the joiner releases its claim and starts over. Writers also *fence* before each chunk (rate-limited with the heartbeat): a writer whose claim
was taken over, or whose plan was superseded, stops.

Every refusal is a :class:`ClaimError`: one line naming the output, the other process (pid, host, start
time) and what to do. ``OutputLock`` is the one-writer-per-output case for any stage (one plan of one shard).
The records and the claims directory are :mod:`looptrace.io.claims_dir`; this module is the protocol
(:class:`Coordinator`) and the one-writer case (:func:`output_lock`, :func:`stage_output`).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from pathlib import Path

from looptrace.io.artifacts import check_output_path, clear_debris
from looptrace.io.claims_dir import (
    ACTIVE_OWNERS,
    LEASE_S,
    PLAN_KINDS,
    ClaimError,
    ClaimsDir,
    Owner,
    Plan,
    claims_location,
    is_live,
    parse_record_name,
)
from looptrace.io.guard import CURRENT_STAGE, check_overlap, check_replaceable
from looptrace.io.interrupts import expect_commit


class Coordinator:
    """This process's side of the claims protocol for one output.

    Args:
        target: the output (path or URL); its claims live in :func:`claims_location`.
        fingerprint: hash of the inputs that decide the output's content.
        shard: ``(i, n)``: this process writes shard ``i`` of ``n``.
        lease_s: a claim of another host without a heartbeat for this long is dead.
        label: the output's name in messages (default: ``target``).
        heartbeat_s: at most one heartbeat + fence per this many seconds (default ``lease_s / 20``, ≤ 30 s).
    """

    def __init__(self, target: str, fingerprint: str, shard: tuple[int, int] = (0, 1), lease_s: float = LEASE_S,
                 label: str | None = None, heartbeat_s: float | None = None):
        self.target, self.fp = str(target), str(fingerprint)
        self.i, self.n = int(shard[0]), int(shard[1])
        if not (self.n >= 1 and 0 <= self.i < self.n):
            raise ClaimError(f"shard {self.i}/{self.n}: need 0 <= i < n")
        self.lease_s = float(lease_s)
        self.heartbeat_s = float(heartbeat_s if heartbeat_s is not None else min(30.0, self.lease_s / 20))
        self.label = label or self.target
        self.dir = ClaimsDir(claims_location(self.target))
        self.me = Owner.me()
        self.held: dict[str, dict] = {}  # record name -> record (ours)
        self.plan_gen: int | None = None
        self._last_beat = 0.0
        ACTIVE_OWNERS.add(self.me.id)

    # -- records ---------------------------------------------------------------------------------
    def _record(self, **fields) -> dict:
        now = time.time()
        return {"owner": asdict(self.me), "heartbeat": now, "state": "active", "fingerprint": self.fp, **fields}

    def _generations(self, names: list[str]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for n in names:
            p = parse_record_name(n)
            if p:
                out.setdefault(p[0], []).append(p[1])
        for v in out.values():
            v.sort()
        return out

    def _plans(self, names: list[str]) -> list[tuple[int, dict]]:
        """Every plan record, newest first."""
        gens = self._generations(names).get("plan", [])
        out = []
        for g in reversed(gens):
            rec = self.dir.read(f"plan@{g}.json")
            if rec is not None:
                out.append((g, rec))
        return out

    def _live_under(self, k: int, names: list[str], plan_rec: dict | None) -> list[dict]:
        """Live records of plan ``k`` (newest generation of each claim, and the plan record itself)."""
        live = []
        if plan_rec is not None and is_live(plan_rec, self.lease_s):
            live.append(plan_rec)
        for base, gens in self._generations(names).items():
            if base.startswith(f"p{k}."):
                rec = self.dir.read(f"{base}@{gens[-1]}.json")
                if is_live(rec, self.lease_s) and (rec or {}).get("owner", {}).get("id") != self.me.id:
                    live.append(rec)
        return [r for r in live if (r.get("owner") or {}).get("id") != self.me.id]

    def current_plan(self) -> Plan | None:
        """The newest plan that is not withdrawn, with its live records; None if there is none."""
        names = self.dir.names()
        for g, rec in self._plans(names):
            if not rec.get("withdrawn"):
                return Plan(g, rec, self._live_under(g, names, rec))
        return None

    def _newer_plan_exists(self, k: int) -> bool:
        return any(g > k and not rec.get("withdrawn") for g, rec in self._plans(self.dir.names()))

    # -- refusals --------------------------------------------------------------------------------
    def _who(self, recs: list[dict]) -> str:
        return Owner.from_record(recs[0]).describe()

    def refuse_incompatible(self, plan: Plan) -> None:
        """Raise the one-line refusal if ``plan`` is live and this process cannot join it."""
        if not plan.active:
            return
        if plan.fingerprint != self.fp:
            raise ClaimError(f"{self.label} is being written by {self._who(plan.live)} with other parameters, "
                             "checkpoint, data or code; wait for it to finish or stop it (or write to another "
                             "output)")
        if plan.n_shards != self.n:
            raise ClaimError(f"{self.label} is being written as {plan.n_shards} shard(s) by {self._who(plan.live)}; "
                             f"shard {self.i}/{self.n} would overlap them (run with --shard i/{plan.n_shards}, or "
                             "wait for it to finish)")

    # -- plans -----------------------------------------------------------------------------------
    def new_plan(self, kind: str) -> int | None:
        """Create the next plan (call only when the current one is inactive). Returns its generation, or None
        when another process created a plan first or an older one went live meanwhile (look again). Raises if
        that live plan cannot be joined (other inputs or shard count)."""
        assert kind in PLAN_KINDS
        names = self.dir.names()
        gens = self._generations(names).get("plan", [])
        k = (gens[-1] + 1) if gens else 0
        rec = self._record(kind=kind, n_shards=self.n, ready=False, withdrawn=False)
        name = f"plan@{k}.json"
        if not self.dir.create(name, rec):
            return None
        self.held[name] = rec
        # the planner's half of the race: nothing under an older plan may be live now
        names = self.dir.names()
        for g, prec in self._plans(names):
            if g >= k:
                continue
            live = self._live_under(g, names, prec)
            if live:
                rec["withdrawn"] = True
                self._put(name, rec)
                self.held.pop(name, None)
                # refused if it cannot be joined; a compatible plan went live after the caller looked (another
                # shard of this run made the layout meanwhile): look again and join it, as a torchrun peer must
                self.refuse_incompatible(Plan(g, prec, live))
                return None
        self.plan_gen = k
        return k

    def set_ready(self) -> None:
        name = f"plan@{self.plan_gen}.json"
        rec = self.held[name]
        rec["ready"] = True
        self._put(name, rec)

    def wait_ready(self, plan: Plan, timeout_s: float = 600.0, poll_s: float = 0.1) -> Plan | None:
        """Wait until the live plan ``plan`` is ready; None if it stopped being the current one or died."""
        t0 = time.monotonic()
        while True:
            cur = self.current_plan()
            if cur is None or cur.gen != plan.gen or not cur.active:
                return None
            if cur.ready:
                return cur
            if time.monotonic() - t0 > timeout_s:
                raise ClaimError(f"{self.label}: {self._who(cur.live)} has been preparing it for {timeout_s:.0f} s; "
                                 "stop it or wait")
            time.sleep(poll_s)

    def wait_inactive(self, plan: Plan, timeout_s: float = 600.0, poll_s: float = 0.1) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            cur = self.current_plan()
            if cur is None or cur.gen != plan.gen or not cur.active:
                return
            time.sleep(poll_s)
        raise ClaimError(f"{self.label}: still being tidied by {self._who(plan.live)} after {timeout_s:.0f} s")

    # -- shard and final claims -----------------------------------------------------------------
    def _acquire(self, k: int, base: str, what: str | None) -> str | None:
        """Take claim ``base`` of plan ``k`` (taking over a dead one). Returns its record name, or None when
        the newest generation is already ``done``. Raises when it is live."""
        while True:
            gens = self._generations(self.dir.names()).get(base, [])
            g = gens[-1] if gens else -1
            if g >= 0:
                cur = self.dir.read(f"{base}@{g}.json")
                if cur is not None and cur.get("state") == "done":
                    return None
                if is_live(cur, self.lease_s):
                    head = f"{self.label} is" if what is None else f"{self.label}: {what} is"
                    raise ClaimError(f"{head} being written by {Owner.from_record(cur).describe()}; wait for it to "
                                     "finish or stop it (a killed run's claim is taken over on rerun)")
            name = f"{base}@{g + 1}.json"
            rec = self._record(plan=k, taken_over=g >= 0)
            if self.dir.create(name, rec):
                self.held[name] = rec
                return name
            # lost the race for g + 1: the winner is live, so the next round refuses (or sees it done)

    def claim_shard(self, k: int) -> str | None:
        """Claim this process's shard under plan ``k``. Returns the claim's name, None if the shard is done
        under this plan already, or raises; re-raises ``_Superseded`` when a newer plan appeared meanwhile."""
        what = None if self.n == 1 else f"shard {self.i}/{self.n}"
        name = self._acquire(k, f"p{k}.shard{self.i}of{self.n}", what)
        if name is not None and self._newer_plan_exists(k):  # the joiner's half of the race
            self.release(name)
            raise Superseded()
        self.plan_gen = k
        self.shard_name = name
        return name

    def claim_final(self, k: int) -> str | None:
        """The finaliser's claim of plan ``k``; None when another process finalises (or did)."""
        try:
            return self._acquire(k, f"p{k}.final", "finalisation")
        except ClaimError:
            return None

    # -- heartbeat, fencing, release --------------------------------------------------------------
    def _put(self, name: str, rec: dict) -> None:
        rec["heartbeat"] = time.time()
        self.dir.overwrite(name, rec)

    def beat(self, force: bool = False) -> None:
        """Heartbeat + fence (at most every ``heartbeat_s``): stop if our shard was taken over or superseded."""
        now = time.monotonic()
        if not force and now - self._last_beat < self.heartbeat_s:
            return
        self._last_beat = now
        name = getattr(self, "shard_name", None)
        if name is None:
            return
        parsed = parse_record_name(name)
        assert parsed is not None and self.plan_gen is not None  # set together by claim_shard
        base, g = parsed
        gens = self._generations(self.dir.names()).get(base, [])
        if (gens and gens[-1] > g) or self._newer_plan_exists(int(self.plan_gen)):
            self.held.pop(name, None)
            what = "" if self.n == 1 else f" (shard {self.i}/{self.n})"
            raise ClaimError(f"{self.label}{what} was taken over by another process (this one was presumed dead); "
                             "stopping")
        for n, rec in self.held.items():
            if rec.get("state") == "active":
                self._put(n, rec)

    def finish(self, name: str | None, **fields) -> None:
        """Mark one of our records ``done`` (with ``fields``)."""
        if name is None or name not in self.held:
            return
        rec = self.held[name]
        rec.update(fields, state="done")
        self._put(name, rec)

    def release(self, name: str) -> None:
        rec = self.held.pop(name, None)
        if rec is not None and rec.get("state") == "active":
            rec["state"] = "released"
            with contextlib.suppress(Exception):
                self._put(name, rec)

    def release_all(self) -> None:
        """On exit: every record still ``active`` becomes ``released`` (a clean exit needs no lease to expire)."""
        for name in list(self.held):
            rec = self.held[name]
            if rec.get("state") == "active":
                self.release(name)
            else:
                self.held.pop(name, None)
        ACTIVE_OWNERS.discard(self.me.id)

    def remove_plans_upto(self, k: int) -> None:
        """Delete every record of plans ``<= k`` and every withdrawn plan (after the output is complete), then the
        directory if empty.

        Only the names listed now are deleted, so a plan created meanwhile by another process survives. A
        peer's last write can re-create its record after this (os.replace onto a removed name); every writer
        that finds the output complete calls this too, so the last one leaves nothing behind."""
        names = self.dir.names()
        drop = []
        for n in names:
            p = parse_record_name(n)
            if p is None:
                continue
            base, g = p
            m = re.match(r"^p(\d+)\.", base)
            plan_k = g if base == "plan" else (int(m[1]) if m else None)
            if plan_k is not None and plan_k <= k:
                drop.append(n)
            elif base == "plan" and (self.dir.read(n) or {}).get("withdrawn"):
                # a withdrawn plan is never joined or claimed under (it lost the planners' race to a live older
                # plan, new_plan); of a later generation, it outlived the plan it yielded to: without this it was
                # left beside the complete output (seen when two shards started at the same moment)
                drop.append(n)
        self.dir.remove(drop)
        self.held = {n: r for n, r in self.held.items() if n not in drop}
        self.dir.remove_if_empty()

    def debris(self) -> bool:
        """Whether records of finished or dead plans are left behind (a killed run's)."""
        return bool(self.dir.names())


class Superseded(Exception):
    """Internal: a newer plan appeared while a shard was being claimed; start over."""


class NullCoordinator(Coordinator):
    """No claims: an in-process store (``zarr.storage.MemoryStore``) can have no other writer process."""

    def __init__(self, fingerprint: str = "", shard: tuple[int, int] = (0, 1), label: str = "<memory>"):
        self.target, self.fp, self.label = label, fingerprint, label
        self.i, self.n = int(shard[0]), int(shard[1])
        self.held, self.plan_gen, self.lease_s, self.heartbeat_s = {}, 0, LEASE_S, 1e9
        self._last_beat = 0.0
        self._plan: dict | None = None

    def current_plan(self) -> Plan | None:
        return None

    def new_plan(self, kind: str) -> int | None:
        self.plan_gen = 0
        return 0

    def set_ready(self) -> None:
        pass

    def claim_shard(self, k: int) -> str | None:
        self.shard_name = None
        return "memory"

    def claim_final(self, k: int) -> str | None:
        return "memory"

    def beat(self, force: bool = False) -> None:
        pass

    def finish(self, name: str | None, **fields) -> None:
        pass

    def release_all(self) -> None:
        pass

    def remove_plans_upto(self, k: int) -> None:
        pass

    def debris(self) -> bool:
        return False


# ---------------------------------------------------------------------------------------------
# One writer per output, for any stage
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def output_lock(target: str | os.PathLike, fingerprint: str = "", lease_s: float = LEASE_S,
                label: str | None = None) -> Iterator[Coordinator]:
    """Hold the only write claim of ``target`` for the duration of the block (any stage's output).

    A second run that enters the block for the same output while the first is alive is refused with one
    line naming it (pid, host, start time); a killed run's claim is taken over. The claims directory is
    removed when the block exits (cleanly or not).

    Usage::

        with output_lock(out_dir):
            write_outputs(out_dir, ...)
    """
    coord = Coordinator(str(target), fingerprint or "-", (0, 1), lease_s, label)
    try:
        while True:
            plan = coord.current_plan()
            if plan is not None and plan.active:
                raise ClaimError(f"{coord.label} is being written by {coord._who(plan.live)}; wait for it to "
                                 "finish or stop it (a killed run's claim is taken over on rerun)")
            k = coord.new_plan("resume")
            if k is None:
                continue
            coord.set_ready()
            try:
                coord.claim_shard(k)
            except Superseded:
                continue
            break
        yield coord
    finally:
        coord.release_all()
        if coord.plan_gen is not None:
            coord.remove_plans_upto(coord.plan_gen)


@contextlib.contextmanager
def stage_output(out_dir: str | os.PathLike, stage: str | None = None,
                 inputs: Mapping[str, str | os.PathLike | None] | None = None,
                 out_root: str | os.PathLike | None = None) -> Iterator[Path]:
    """What a stage holds while it writes ``out_dir``: :func:`output_lock`, after refusing an ``out_dir`` that is
    (or lies under) a file, and with a killed run's staging debris beside it removed
    (:func:`looptrace.io.artifacts.clear_debris`). Parent directories this call creates are removed again when the
    block leaves them empty (a refused run leaves no trace).

    Before anything is written, ``out_root`` (default ``out_dir``; the ``--out`` root) must not overlap any of
    ``inputs`` (option name -> input root; :func:`looptrace.io.guard.check_overlap`), and an existing ``out_dir``
    must be one this ``stage`` wrote (:func:`looptrace.io.guard.check_replaceable`); the swap checks it again.

    Raises:
        InputError: ``out_dir`` or a parent is a file; the output overlaps an input root or holds what another
            stage wrote. ClaimError: another live run writes ``out_dir``.
    """
    out_dir = Path(out_dir)
    check_overlap(out_dir if out_root is None else out_root, inputs or {})
    token = CURRENT_STAGE.set(stage) if stage is not None else None
    missing = [p for p in out_dir.parents if not p.exists()]
    try:
        check_output_path(out_dir)
        check_replaceable(out_dir)
        expect_commit(out_dir)  # its swap commits the stage (looptrace.io.interrupts)
        with output_lock(out_dir):
            clear_debris(out_dir)
            yield out_dir
    finally:
        for p in missing:  # innermost first
            with contextlib.suppress(OSError):
                p.rmdir()  # only if empty
        if token is not None:
            CURRENT_STAGE.reset(token)


__all__ = ["LEASE_S", "ClaimError", "Coordinator", "NullCoordinator", "Superseded", "output_lock", "stage_output"]
