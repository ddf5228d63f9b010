"""`BatchStore`: the batch lane's files, batches and per-line results in one SQLite database
(an embedded database: nothing to run), so they outlive the frontend process.

Tables:
- `files`: uploaded inputs and the output/error files a batch writes (content as a blob);
- `batches`: one row per batch, its status, timestamps, counts, and the runner holding it
  (`runner`, `lease_until`: the frontend process that runs it; an expired lease is taken over,
  so a restarted frontend, or another one sharing the database, resumes it);
- `lines`: one row per input line, `pending` until its answer is written (`done` / `failed`,
  with the output or error line): a line is never lost, and one that was in flight when a
  process died runs again.

Every method is blocking and thread-safe (one connection behind a lock); async callers run
them with `asyncio.to_thread`. Several processes on a host may share the file (WAL mode).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, body TEXT NOT NULL, status TEXT NOT NULL,
    created_at INTEGER NOT NULL, total INTEGER NOT NULL, completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0, runner TEXT, lease_until REAL);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, body BLOB,
    state TEXT NOT NULL, result BLOB, PRIMARY KEY (batch_id, idx));
CREATE INDEX IF NOT EXISTS lines_pending ON lines (batch_id, state, idx);
"""
# a batch in one of these states still has work for a runner
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


class FileRow(NamedTuple):
    id: str
    owner: str
    purpose: str
    filename: str
    bytes: int
    created_at: int


class LineRow(NamedTuple):
    """An input line; `body` the request's JSON body, `state` pending / done / failed."""

    batch_id: str
    idx: int
    custom_id: str
    body: bytes | None
    state: str


class NewLine(NamedTuple):
    """A line as a batch is created: runnable (`body`), or already failed (`result`: its
    error-file line, e.g. for a line that is not valid JSON)."""

    custom_id: str
    body: bytes | None
    result: bytes | None


class BatchStore:
    def __init__(self, path: Path | None) -> None:
        """`path` None: an in-memory database (kept for this object's life only)."""
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            str(path) if path else ":memory:", check_same_thread=False, timeout=30.0
        )
        with self._lock:
            if path is not None:
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
            self._db.commit()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _run(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock, self._db:  # one transaction, committed on leaving
            return self._db.execute(sql, args).fetchall()

    # ------------------------------------------------------------------ files
    def add_file(self, row: FileRow, content: bytes) -> None:
        self._run("INSERT INTO files VALUES (?,?,?,?,?,?,?)", (*row, content))

    def file(self, file_id: str, owner: str) -> FileRow | None:
        """`owner`'s file, or None (unknown, or someone else's)."""
        rows = self._run(
            "SELECT id, owner, purpose, filename, bytes, created_at FROM files "
            "WHERE id=? AND owner=?",
            (file_id, owner),
        )
        return FileRow(*rows[0]) if rows else None

    def file_content(self, file_id: str, owner: str) -> bytes | None:
        rows = self._run("SELECT content FROM files WHERE id=? AND owner=?", (file_id, owner))
        return bytes(rows[0][0]) if rows else None

    def files(self, owner: str, purpose: str | None) -> list[FileRow]:
        """`owner`'s files, newest first."""
        sql = "SELECT id, owner, purpose, filename, bytes, created_at FROM files WHERE owner=?"
        args: list[Any] = [owner]
        if purpose is not None:
            sql, args = sql + " AND purpose=?", [*args, purpose]
        return [FileRow(*r) for r in self._run(sql + " ORDER BY created_at DESC, id DESC", args)]

    def delete_file(self, file_id: str, owner: str) -> bool:
        with self._lock, self._db:
            cur = self._db.execute("DELETE FROM files WHERE id=? AND owner=?", (file_id, owner))
            return cur.rowcount > 0

    # ------------------------------------------------------------------ batches
    def add_batch(self, body: dict[str, Any], owner: str, lines: Sequence[NewLine]) -> None:
        """Store a new batch (`body`: its Batch object) and its lines, in one transaction."""
        num_failed = sum(1 for line in lines if line.result is not None)
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO batches (id, owner, body, status, created_at, total, failed) "
                "VALUES (?,?,?,?,?,?,?)",
                (body["id"], owner, json.dumps(body), body["status"], body["created_at"],
                 len(lines), num_failed),
            )  # fmt: skip
            self._db.executemany(
                "INSERT INTO lines VALUES (?,?,?,?,?,?)",
                (
                    (body["id"], i, ln.custom_id, ln.body,
                     "pending" if ln.result is None else "failed", ln.result)
                    for i, ln in enumerate(lines)
                ),
            )  # fmt: skip

    def batch(self, batch_id: str, owner: str | None) -> dict[str, Any] | None:
        """The Batch object with its current counts; None if unknown or (with `owner`)
        someone else's."""
        sql = "SELECT body, status, total, completed, failed FROM batches WHERE id=?"
        args: list[Any] = [batch_id]
        if owner is not None:
            sql, args = sql + " AND owner=?", [*args, owner]
        rows = self._run(sql, args)
        return _object(rows[0]) if rows else None

    def batches(self, owner: str) -> list[dict[str, Any]]:
        """`owner`'s batches, newest first."""
        rows = self._run(
            "SELECT body, status, total, completed, failed FROM batches WHERE owner=? "
            "ORDER BY created_at DESC, rowid DESC",
            (owner,),
        )
        return [_object(r) for r in rows]

    def owner_of(self, batch_id: str) -> str | None:
        rows = self._run("SELECT owner FROM batches WHERE id=?", (batch_id,))
        return str(rows[0][0]) if rows else None

    def begin(self, batch_id: str, at: int) -> None:
        """validating → in_progress (`in_progress_at`), only while it is validating: a cancel
        that came first wins."""
        self._set(batch_id, "in_progress", {"in_progress_at": at}, only_from="validating")

    def update(self, batch_id: str, status: str, **fields: Any) -> dict[str, Any] | None:
        """Set the status and Batch fields (e.g. `completed_at`) of a batch."""
        return self.batch(batch_id, None) if self._set(batch_id, status, fields) else None

    def _set(
        self, batch_id: str, status: str, fields: dict[str, Any], only_from: str | None = None
    ) -> bool:
        """Write the status and fields into the batch's row and body; False when there is no
        such batch, or (with `only_from`) its status is another."""
        with self._lock, self._db:
            rows = self._db.execute(
                "SELECT body, status FROM batches WHERE id=?", (batch_id,)
            ).fetchall()
            if not rows or (only_from is not None and rows[0][1] != only_from):
                return False
            body = json.loads(rows[0][0])
            body.update(fields, status=status)
            self._db.execute(
                "UPDATE batches SET body=?, status=? WHERE id=?",
                (json.dumps(body), status, batch_id),
            )
        return True

    def status_counts(self) -> dict[str, int]:
        """How many batches are in each status (metrics)."""
        return dict(self._run("SELECT status, count(*) FROM batches GROUP BY status"))

    def progress(self, statuses: Iterable[str] = ACTIVE) -> list[tuple[str, int, int, int]]:
        """(batch id, total, completed, failed) of every batch in `statuses` (metrics)."""
        marks = ",".join("?" * len(tuple(statuses)))
        return [
            (str(r[0]), int(r[1]), int(r[2]), int(r[3]))
            for r in self._run(
                f"SELECT id, total, completed, failed FROM batches WHERE status IN ({marks})",
                tuple(statuses),
            )
        ]

    # ------------------------------------------------------------------ runners
    def claim(self, runner: str, lease_s: float) -> list[tuple[str, str, str]]:
        """Take (or renew) the lease of every active batch that no other runner holds; the
        (id, status, owner) of those `runner` now holds, oldest first."""
        now = time.time()
        with self._lock, self._db:
            marks = ",".join("?" * len(ACTIVE))
            self._db.execute(
                f"UPDATE batches SET runner=?, lease_until=? WHERE status IN ({marks}) AND "
                "(runner IS NULL OR runner=? OR lease_until < ?)",
                (runner, now + lease_s, *ACTIVE, runner, now),
            )
            rows = self._db.execute(
                f"SELECT id, status, owner FROM batches WHERE runner=? AND status IN ({marks}) "
                "ORDER BY created_at, rowid",
                (runner, *ACTIVE),
            ).fetchall()
        return [(str(r[0]), str(r[1]), str(r[2])) for r in rows]

    def release(self, runner: str) -> None:
        """Give up `runner`'s leases (a clean stop: another runner resumes at once)."""
        self._run("UPDATE batches SET runner=NULL, lease_until=NULL WHERE runner=?", (runner,))

    def pending_lines(self, batch_id: str, skip: set[int], limit: int) -> list[LineRow]:
        """Up to `limit` pending lines of a batch, in order, except the indexes in `skip`."""
        rows = self._run(
            "SELECT batch_id, idx, custom_id, body, state FROM lines "
            "WHERE batch_id=? AND state='pending' ORDER BY idx LIMIT ?",
            (batch_id, limit + len(skip)),
        )
        return [LineRow(*r) for r in rows if r[1] not in skip][:limit]

    def finish_line(self, batch_id: str, idx: int, *, ok: bool, result: bytes) -> bool:
        """Record a line's answer once (False when it was no longer pending)."""
        state, counter = ("done", "completed") if ok else ("failed", "failed")
        with self._lock, self._db:
            cur = self._db.execute(
                "UPDATE lines SET state=?, result=? WHERE batch_id=? AND idx=? AND state='pending'",
                (state, result, batch_id, idx),
            )
            if cur.rowcount == 0:
                return False
            self._db.execute(
                f"UPDATE batches SET {counter}={counter}+1 WHERE id=?", (batch_id,)
            )  # counter is one of two literals
        return True

    def results(self, batch_id: str, state: str) -> list[bytes]:
        """The output (`done`) or error (`failed`) lines of a batch, in input order."""
        rows = self._run(
            "SELECT result FROM lines WHERE batch_id=? AND state=? ORDER BY idx",
            (batch_id, state),
        )
        return [bytes(r[0]) for r in rows]

    def pending_custom_ids(self, batch_id: str) -> list[tuple[int, str]]:
        rows = self._run(
            "SELECT idx, custom_id FROM lines WHERE batch_id=? AND state='pending' ORDER BY idx",
            (batch_id,),
        )
        return [(int(r[0]), str(r[1])) for r in rows]


def _object(row: tuple[Any, ...]) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(row[0])
    body["status"] = row[1]
    body["request_counts"] = {"total": row[2], "completed": row[3], "failed": row[4]}
    return body
