"""Result tables (``timm_sortconv.cli.records``): a record reads back as it was written, a job's row is found and
replaced by its key, and processes that add rows at the same time lose none of them."""
import multiprocessing
import random

import pytest

from timm_sortconv.cli.records import RecordTable, decode, encode, read_records, write_records


def test_a_record_reads_back_as_it_was_written(tmp_path):
    rng = random.Random(0)
    records = [{"name": "p_rs_7", "seed": seed, "mean": rng.uniform(0, 100) / 3, "lr": 2e-3, "tiny": 1e-300,
                "augment": seed % 2 == 0, "model_kwargs": {} if seed else {"channels": [16, 32], "blur": 0.7},
                "per_angle": [rng.random() for _ in range(5)], "command": "python x.py --name 'a b', c",
                "sweep": {"mean": rng.random(), "angles": [0.0, 90.0]}} for seed in range(4)]
    records[1]["only_here"] = 7
    path = tmp_path / "t.csv"
    write_records(path, records, spread=("sweep",))
    assert read_records(path) == records  # floats to the last bit, types, nesting, columns some rows lack
    header = path.read_text().splitlines()[0].split(",")
    assert {"sweep.mean", "sweep.angles", "model_kwargs", "only_here"} <= set(header) and "sweep" not in header


def test_none_and_missing_fields_are_empty_cells_and_read_as_missing(tmp_path):
    path = tmp_path / "t.csv"
    write_records(path, [{"row": "a", "time_of": None, "sweep": {"mean": 1.5}}, {"row": "b"}], spread=("sweep",))
    assert read_records(path) == [{"row": "a", "sweep": {"mean": 1.5}}, {"row": "b"}]
    assert read_records(tmp_path / "none.csv") == []


@pytest.mark.parametrize("value", [0, -3, 12345678901234567890, 0.1, -2.5e-7, 1e22, float("inf"), True, False,
                                   "plain", "0 1 2", "1.50", "007", "", [1, "a"], {"k": [0.5]}])
def test_each_cell_decodes_to_the_value_it_encodes(value):
    decoded = decode(encode(value))
    assert (decoded is None) if value == "" else (decoded == value and type(decoded) is type(value))


def test_a_row_is_found_and_replaced_by_its_key_in_place(tmp_path):
    table = RecordTable(tmp_path / "sub" / "t.csv", key=("row", "seed"))
    for seed in (0, 1, 2):
        table.put({"row": "a", "seed": seed, "mean": float(seed)})
    table.put({"row": "a", "seed": 1, "mean": 9.0, "new": "column"})
    assert [r["mean"] for r in table.records()] == [0.0, 9.0, 2.0]
    assert table.find(row="a", seed=1)["new"] == "column" and table.find(row="a", seed=3) is None
    assert {"row": "a", "seed": 2} in table and {"row": "b", "seed": 2} not in table
    assert [r["seed"] for r in table.records(row="a")] == [0, 1, 2]
    with pytest.raises(ValueError, match="missing: seed"):
        table.put({"row": "a", "mean": 1.0})


def _add_rows(path: str, worker: int, count: int) -> None:
    table = RecordTable(path, key=("worker", "job"))
    for job in range(count):
        table.put({"worker": worker, "job": job, "value": worker * 1000 + job})


def test_processes_adding_rows_at_once_lose_none(tmp_path):
    path = str(tmp_path / "shared.csv")
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    workers = [context.Process(target=_add_rows, args=(path, w, 15)) for w in range(4)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(120)
        assert p.exitcode == 0
    rows = read_records(path)
    assert sorted((r["worker"], r["job"]) for r in rows) == [(w, j) for w in range(4) for j in range(15)]
    assert all(r["value"] == r["worker"] * 1000 + r["job"] for r in rows)
    assert not [p for p in tmp_path.iterdir() if p.name != "shared.csv"]  # no temporary file left behind
