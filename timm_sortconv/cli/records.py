"""Result tables: one CSV file per study, one row per finished job (as timm keeps its ``results/``).

A study (an ablation, the decision table, the MNIST rows of RESULTS.md) runs jobs, each ending in one record, a
``dict``; :class:`RecordTable` keeps the records of one study as the rows of one CSV file, so that a reader opens
one table instead of a folder of files, and a script that resumes skips the jobs whose row is there.

How a record becomes a row, and back:

* Numbers, text and booleans (``true``/``false``) are cells as they are; a float is written as Python's
  ``repr``, so it reads back to the same float (the tables computed from it are the same to the last digit).
* A dict field named in ``spread`` is one column per key, ``field.key`` (``mnist_rot.mean``): the figures a reader
  looks for, in columns. Any other dict or list is one cell of JSON (``model_kwargs``, a per-angle list).
* ``None`` and a missing field are an empty cell, and an empty cell is a missing field; a ``field.key`` group whose
  cells are all empty is a missing dict. A text cell that reads as a number, JSON list or object, or
  ``true``/``false`` reads as that value: records hold no such text.

Writing is safe for several processes sharing the work of one study: :meth:`RecordTable.put` takes an exclusive
lock on the file (``fcntl.flock``, where the platform has it), reads it, adds or replaces the row, writes the
whole table to a temporary file beside it and moves that over the table (``os.replace``), so a reader sees the
old table or the new one, never half a row, and a job killed while writing leaves the table as it was.

Example::

    >>> import tempfile, os
    >>> table = RecordTable(os.path.join(tempfile.mkdtemp(), "runs.csv"), key=("name", "seed"), spread=("sweep",))
    >>> table.put({"name": "p_rs_7", "seed": 0, "kwargs": {}, "sweep": {"mean": 91.25, "worst": 86.5}})
    >>> table.find(name="p_rs_7", seed=0)["sweep"]
    {'mean': 91.25, 'worst': 86.5}
    >>> table.find(name="p_rs_7", seed=1) is None
    True
"""
from __future__ import annotations

import csv
import json
import math
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Union

try:
    import fcntl
except ImportError:  # not on Windows: one process at a time there
    fcntl = None

__all__ = ["RecordTable", "decode", "encode", "read_records", "write_records"]

PathLike = Union[str, "os.PathLike[str]"]


def encode(value) -> str:
    """One cell's text for a value of a record (see the module docstring)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return repr(value) if isinstance(value, float) else str(value)
    return json.dumps(value)


def decode(cell: str):
    """The value of a cell :func:`encode` wrote (``None`` for an empty one)."""
    if cell == "":
        return None
    if cell in ("true", "false"):
        return cell == "true"
    if cell[0] in "[{":
        return json.loads(cell)
    try:
        number = int(cell)
        if str(number) == cell:
            return number
    except ValueError:
        pass
    try:
        number = float(cell)
    except ValueError:
        return cell
    return number if repr(number) == cell or math.isnan(number) or math.isinf(number) else cell


def _flatten(record: Dict, spread: Sequence[str]) -> Dict[str, str]:
    row = {}
    for field, value in record.items():
        if field in spread and isinstance(value, dict):
            row.update({f"{field}.{key}": encode(item) for key, item in value.items()})
        else:
            row[field] = encode(value)
    return row


def _unflatten(row: Dict[str, str]) -> Dict:
    record: Dict = {}
    for column, cell in row.items():
        value = decode(cell)
        field, dot, key = column.partition(".")
        if value is None:
            continue
        if dot:
            record.setdefault(field, {})[key] = value
        else:
            record[field] = value
    return record


def read_records(path: PathLike) -> List[Dict]:
    """Every record of the table at ``path``, in its order (an empty list when there is no file)."""
    try:
        with open(path, newline="") as f:
            return [_unflatten(row) for row in csv.DictReader(f)]
    except FileNotFoundError:
        return []


def write_records(path: PathLike, records: Sequence[Dict], spread: Sequence[str] = ()) -> None:
    """Writes ``records`` as the table at ``path`` (replacing it at once; columns in the order first met)."""
    rows = [_flatten(record, spread) for record in records]
    columns = list(dict.fromkeys(column for row in rows for column in row))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


class RecordTable:
    """The records of one study in one CSV file, each identified by the values of its ``key`` fields.

    Args:
        path: the CSV file (created by the first :meth:`put`).
        key: the fields that name a job (e.g. ``("row", "task", "seed")``); :meth:`put` replaces a row with the
            same values, and :meth:`find` looks one up.
        spread: the dict fields written as one column per key (see the module docstring).
    """

    def __init__(self, path: PathLike, key: Sequence[str], spread: Sequence[str] = ()):
        self.path, self.key, self.spread = Path(path), tuple(key), tuple(spread)

    def __repr__(self) -> str:
        return f"RecordTable({str(self.path)!r}, key={self.key})"

    def records(self, **where) -> List[Dict]:
        """The table's records, in its order; with ``where``, those whose fields have those values."""
        return [r for r in read_records(self.path) if all(r.get(k) == v for k, v in where.items())]

    def find(self, **key) -> Optional[Dict]:
        """The record with these values of the ``key`` fields, or None."""
        return next(iter(self.records(**key)), None)

    def __contains__(self, record: Dict) -> bool:
        """Whether the table holds a row with ``record``'s values of the ``key`` fields (a finished job)."""
        return self.find(**{k: record.get(k) for k in self.key}) is not None

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            f = open(self.path, "a")
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                # another process may have replaced the file while this one waited: lock the file there is now
                if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino:
                    yield
                    return
            finally:
                f.close()  # closing releases the lock

    def put(self, record: Dict) -> None:
        """Adds ``record`` as a row, or replaces the row with its values of the ``key`` fields, in place."""
        missing = [k for k in self.key if record.get(k) is None]
        if missing:
            raise ValueError(f"a record of {self.path} needs its key fields; missing: {', '.join(missing)}")
        with self._locked():
            records = read_records(self.path)
            same = [i for i, r in enumerate(records) if all(r.get(k) == record[k] for k in self.key)]
            if same:
                records[same[0]] = record
                records = [r for i, r in enumerate(records) if i not in same[1:]]
            else:
                records.append(record)
            write_records(self.path, records, self.spread)
