"""The queue's store: scored groups in SQLite, each step's batch assembled exactly once.

Scored groups are persisted (WAL, synchronous=FULL) before a push is acknowledged.

The store lives in the run directory, which on a cluster is a network filesystem (NFS,
Lustre). WAL's default index is a shared-memory file beside the database (`-shm`), which
SQLite's documentation says does not work over a network filesystem (https://sqlite.org/wal.html:
"all processes using a database must be on the same host computer"). The queue is the store's
only user, so it opens it with `locking_mode=EXCLUSIVE` before its first access: SQLite then
keeps the WAL index in the process's own memory and never creates the `-shm` file ("Use of WAL
Without Shared-Memory", same page), and holds the database's lock for as long as the queue
runs. A queue killed outright leaves the database and its `-wal` file; the next one rebuilds
the index from the WAL when it opens them (tests/test_queue.py kills one with SIGKILL). Step N's
batch is assembled once, from the oldest fresh groups (stale ones are dropped and counted), and
recorded, so a rank that asks for the same step again gets the same shard.

Every write is one locked transaction that commits or rolls back whole (`Store.transaction`),
so a failed request leaves nothing behind, and the capacity check happens inside the push's
own transaction, so concurrent pushes cannot overfill the queue.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from enum import Enum
from pathlib import Path

from rl.core import wire
from rl.core.disk import writing
from rl.core.records import Group
from rl.core.rundir import write_atomic
from rl.queue.shards import partition

SCHEMA_VERSION = 1
"""`PRAGMA user_version` of the store this code writes (0: the per-group layout before it)."""
PAGE_BYTES = 65536
"""SQLite page size of a new store. A step's push is megabytes: with 4 KiB pages SQLite wrote
235 MB/s of 7.4 MB blobs here, with 64 KiB pages 680 MB/s (benchmarks/RESULTS.md)."""
CACHED_STEPS = 4
"""Assembled steps kept decoded in memory: every rank of a step reads the same one."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS pushes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    batch INTEGER UNIQUE,
    body BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS groups (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    push INTEGER NOT NULL REFERENCES pushes(id),
    position INTEGER NOT NULL,
    min_version INTEGER NOT NULL,
    state TEXT NOT NULL DEFAULT 'ready',
    step INTEGER
);
CREATE INDEX IF NOT EXISTS groups_state ON groups(state, id);
CREATE INDEX IF NOT EXISTS groups_step ON groups(step, id);
"""


class Refused(Enum):
    """Why `Store.push` stored nothing."""

    duplicate = "duplicate"
    """The batch number was pushed before (a retry whose answer was lost)."""
    full = "full"
    """The groups would take the queue past its capacity."""
    ahead = "ahead"
    """The batch number is further past the next batch than the queue allows: not one the
    schedule sends yet (stored, it would make the real one a duplicate)."""


class StoreLost(RuntimeError):
    """The store holds less than it once committed (a damaged WAL); the text names the range."""


@dataclass(frozen=True)
class Marks:
    """High-water marks of what the store has committed, kept in a small fsynced file beside it.

    SQLite stops reading its WAL at the first frame whose checksum fails and drops every later
    transaction without an error. The file is rewritten after each commit that moves a mark, so
    on start a store that holds less than its marks has lost committed data, and says so."""

    next_batch: int = 0
    """One past the highest batch number pushed."""
    last_step: int = -1
    """The highest step assembled."""
    groups: int = 0
    """Groups ever stored (the highest group id)."""

    def lost(self, held: Marks) -> list[str]:
        """What `held` lacks of these marks, as ranges; empty when nothing is missing."""
        spans = [
            ("batches", held.next_batch, self.next_batch - 1),
            ("assembled steps", held.last_step + 1, self.last_step),
            ("groups", held.groups + 1, self.groups),
        ]
        return [f"{name} {low}..{high}" for name, low, high in spans if low <= high]

    @staticmethod
    def read(path: Path) -> Marks | None:
        try:
            return Marks(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None

    def write(self, path: Path) -> None:
        """Replace `path` with these marks, durably (file and directory fsynced)."""
        write_atomic(path, json.dumps(asdict(self)), durable=True)


class Store:
    """Durable group storage and batch assembly; every write is one transaction.

    A push is stored as one row holding its groups in the binary wire format, and one small
    row per group (its place in that push, its version, its state), so storing a step costs one
    blob insert and one fsync however many samples it holds. The store is this process's alone:
    its marks and the ready count live in memory too, so polling never waits on a commit."""

    def __init__(self, path: Path, marks_path: Path | None = None) -> None:
        self.path, self.marks_path = path, marks_path
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            self._open(marks_path)
        except BaseException:
            self.db.close()  # a store refused holds no lock
            raise

    def _open(self, marks_path: Path | None) -> None:
        with writing(self.path):
            # Before the first access: SQLite then keeps WAL's index in this process's memory
            # and never creates the shared-memory file (module docstring).
            self.db.execute("PRAGMA locking_mode=EXCLUSIVE")
            if self.db.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
                self._create()
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
        self.lock = threading.RLock()
        self.marks = self._held()
        self.ready = self._count("ready")
        self._cache: dict[int, list[Group]] = {}
        self._partitions: dict[tuple[int, int], list[list[int]]] = {}
        self._cache_lock = threading.RLock()
        self._marks_lock = threading.Lock()
        self._written: Marks | None = None
        if marks_path is not None:
            self._check_marks(marks_path)

    def close(self) -> None:
        """Close the database, and with it the lock this store holds on it."""
        self.db.close()

    def _create(self) -> None:
        tables = self.db.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall()
        if tables:
            raise StoreLost(
                f"queue store {self.path} has another layout (schema version "
                f"{self.db.execute('PRAGMA user_version').fetchone()[0]}, this queue writes "
                f"{SCHEMA_VERSION}): finish its run with the Relay that started it"
            )
        self.db.execute(f"PRAGMA page_size={PAGE_BYTES}")
        self.db.executescript(SCHEMA)
        self.db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _held(self) -> Marks:
        """The marks as the database has them."""
        batch = self.db.execute("SELECT MAX(batch) FROM pushes").fetchone()[0]
        step = self.db.execute("SELECT MAX(step) FROM groups WHERE state='assigned'").fetchone()
        groups = self.db.execute("SELECT MAX(id) FROM groups").fetchone()[0]
        return Marks(
            next_batch=0 if batch is None else batch + 1,
            last_step=-1 if step[0] is None else step[0],
            groups=groups or 0,
        )

    def _check_marks(self, marks_path: Path) -> None:
        recorded = Marks.read(marks_path)
        lost = recorded.lost(self.marks) if recorded else []
        if lost:
            raise StoreLost(
                f"queue store {self.path} holds less than it committed: {', '.join(lost)} are "
                f"gone (recorded in {marks_path}: {recorded}; the store holds {self.marks}). "
                "A damaged or truncated write-ahead log (-wal) drops every later transaction "
                f"without an error. Refusing to start; to go on from what the store holds, "
                f"accepting the loss, delete {marks_path}."
            )
        self._written = recorded
        self._record_marks()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One locked write transaction: committed when the block ends (returns included),
        rolled back on any error, so a failure never leaves the connection mid-transaction.
        A full disk raises rl/core/disk.py's DiskFull naming the store."""
        with writing(self.path), self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def _record_marks(self) -> None:
        """Make the marks durable after a commit moved them, before the request is answered.
        Outside the store's lock, so the next commit need not wait; writers queue on their own
        lock and each writes the newest marks, so a burst of commits costs fewer writes."""
        if self.marks_path is None:
            return
        with self._marks_lock:
            if self._written != self.marks:
                newest = self.marks
                newest.write(self.marks_path)
                self._written = newest

    def push(
        self,
        groups: list[Group],
        batch: int | None = None,
        capacity: int | None = None,
        body: bytes | None = None,
        ahead: int | None = None,
    ) -> list[int] | Refused:
        """Store groups in one transaction (one fsync) and return their ids; or store nothing
        and say why: `batch` was pushed before, is more than `ahead` past the next batch, or
        the ready groups would exceed `capacity`.
        `body` is the groups already encoded (`stored_body`), if the caller has them."""
        body = body or wire.encode([g.to_dict() for g in groups])
        first = 0
        with self.lock:
            with self.transaction() as db:
                if batch is not None:
                    if db.execute("SELECT 1 FROM pushes WHERE batch=?", (batch,)).fetchone():
                        return Refused.duplicate
                    if ahead is not None and batch > self.marks.next_batch + ahead:
                        return Refused.ahead
                if capacity is not None and self.ready + len(groups) > capacity:
                    return Refused.full
                push = db.execute("INSERT INTO pushes (batch, body) VALUES (?,?)", (batch, body))
                first = self.marks.groups + 1
                rows = [(first + i, push.lastrowid, i, g.min_version) for i, g in enumerate(groups)]
                insert = "INSERT INTO groups (id, push, position, min_version) VALUES (?,?,?,?)"
                db.executemany(insert, rows)
            self.ready += len(groups)
            pushed = self.marks.next_batch if batch is None else batch + 1
            last = first + len(groups) - 1
            next_batch = max(pushed, self.marks.next_batch)
            self.marks = replace(self.marks, next_batch=next_batch, groups=last)
        self._record_marks()
        return list(range(first, last + 1))

    def next_batch(self) -> int:
        """One past the highest batch number pushed (0 before any)."""
        return self.marks.next_batch

    def last_step(self) -> int:
        """The highest step assembled (-1 before any)."""
        return self.marks.last_step

    def count(self, state: str) -> int:
        if state == "ready":
            return self.ready
        with self.lock:
            return self._count(state)

    def _count(self, state: str) -> int:
        query = "SELECT COUNT(*) FROM groups WHERE state=?"
        return self.db.execute(query, (state,)).fetchone()[0]

    def assemble(self, step: int, groups: int, max_off_policy: int) -> tuple[bool, int]:
        """Assign `groups` fresh groups to `step` if enough are ready; returns (done, dropped)."""
        with self.lock:
            if step <= self.marks.last_step:  # another rank assembled it first
                return True, 0
            if self.ready < groups:  # cannot succeed (stale groups are dropped when it can)
                return False, 0
            with self.transaction() as db:
                dropped = db.execute(
                    "UPDATE groups SET state='dropped', step=? WHERE state='ready' "
                    "AND ? - min_version > ?",
                    (step, step, max_off_policy),
                ).rowcount
                query = "SELECT id FROM groups WHERE state='ready' ORDER BY id LIMIT ?"
                ids = [r[0] for r in db.execute(query, (groups,))]
                done = len(ids) == groups
                if done:
                    marks = ",".join("?" * len(ids))
                    db.execute(
                        f"UPDATE groups SET state='assigned', step=? WHERE id IN ({marks})",
                        (step, *ids),
                    )
            self.ready -= dropped + (len(ids) if done else 0)
            if done:
                self.marks = replace(self.marks, last_step=step)
        self._record_marks()
        return done, dropped

    def batch(self, step: int) -> list[Group]:
        """The groups assembled for `step`, in order (arrays as numpy views; kept for the
        last few steps, since every rank asks for the same step)."""
        with self._cache_lock:
            groups = self._cache.get(step)
            if groups is None:
                groups = self._cache[step] = self._read_batch(step)
                while len(self._cache) > CACHED_STEPS:  # the first read goes first
                    del self._cache[next(iter(self._cache))]
            return groups

    def _read_batch(self, step: int) -> list[Group]:
        """Step `step`'s groups, decoded from their pushes (checked when they were pushed)."""
        with self.lock:
            rows = self.db.execute(
                "SELECT push, position FROM groups WHERE step=? AND state='assigned' ORDER BY id",
                (step,),
            ).fetchall()
            pushes = {
                push: self.db.execute("SELECT body FROM pushes WHERE id=?", (push,)).fetchone()[0]
                for push in sorted({push for push, _ in rows})
            }
        decoded = {push: wire.decode(body, lists=False)[0] for push, body in pushes.items()}
        return [Group.parse(decoded[push][position], check_arrays=False) for push, position in rows]

    def partition(self, step: int, world: int) -> list[list[int]]:
        """Sample indices of each of `world` ranks in step `step`'s batch (computed once)."""
        with self._cache_lock:
            key = (step, world)
            if key not in self._partitions:
                sizes = [s.tokens for g in self.batch(step) for s in g.samples]
                self._partitions = {
                    k: v for k, v in self._partitions.items() if k[0] in self._cache
                }
                self._partitions[key] = partition(sizes, world)
            return self._partitions[key]

    def dropped(self, step: int) -> int:
        with self.lock:
            return self.db.execute(
                "SELECT COUNT(*) FROM groups WHERE state='dropped' AND step=?", (step,)
            ).fetchone()[0]
