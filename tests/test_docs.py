"""README.md, RESULTS.md and BENCHMARKS.md agree with the stored results their figures come from, and stay short.

``scripts/docs.py`` writes every generated block (``<!-- docs: NAME -->``) from the stored JSON/CSV; these tests
regenerate the blocks and fail when a document says something else, or when a stored row lacks the command,
date and machine that measured it."""
import csv
import re
from pathlib import Path

import pytest
from conftest import load_script

REPO = Path(__file__).resolve().parents[1]
docs = load_script(REPO / "scripts" / "docs.py", "docs")


def test_every_generated_block_is_what_the_stored_results_give():
    assert docs.differences() == []


def test_each_document_uses_known_blocks_and_the_readme_its_headlines():
    used = {}
    for name in docs.DOCUMENTS:
        for match in docs.MARK.finditer((REPO / name).read_text()):
            assert match.group("name") in docs.BLOCKS, (name, match.group("name"))
            used.setdefault(match.group("name"), set()).add(name)
    assert used["speed"] == {"BENCHMARKS.md"} and used["speed-brief"] == {"README.md"}  # from the same rows
    assert used["mnist"] == {"RESULTS.md"} and used["mnist-brief"] == {"README.md"}
    assert {"demo", "decision"} <= set(used)


def test_a_changed_stored_result_makes_its_blocks_differ(tmp_path, monkeypatch):
    # the check cannot pass on a stale document: a row's time changed in the store changes the speed headline
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    for path in docs.BENCH.glob("*.csv"):
        rows = docs.read_csv(path)
        if path.name == "cpu_layers.csv":
            rows[0]["sc_fb_ms"] = str(float(rows[0]["sc_fb_ms"]) * 3)
        with open(bench / path.name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    monkeypatch.setattr(docs, "BENCH", bench)
    assert {"README.md: speed-brief", "BENCHMARKS.md: speed", "BENCHMARKS.md: cpu-layers"} <= \
        set(docs.differences())


@pytest.mark.parametrize("path", sorted((REPO / "results" / "benchmarks").glob("*.csv")), ids=lambda p: p.name)
def test_every_stored_benchmark_row_names_its_command_date_and_machine(path):
    rows = docs.read_csv(path)
    assert rows
    for row in rows:
        assert row["command"].startswith(("python ", "ONEDNN_MAX_CPU_ISA")) and re.match(r"20\d\d-\d\d-\d\d", row["date"])
        assert row.get("machine") or row.get("gpu")


# The most words (``wc -w``) each document may hold: the detail goes next to its data (results/benchmarks/README.md,
# scripts/research/results/README.md), so that a reader finishes the document.
MOST_WORDS = {"README.md": 1500, "BENCHMARKS.md": 4000, "RESULTS.md": 5000}


def test_documents_a_user_reads_in_minutes():
    readme = (REPO / "README.md").read_text().splitlines()
    assert len(readme) <= 150
    for name, most in MOST_WORDS.items():
        words = len((REPO / name).read_text().split())
        assert words <= most, f"{name}: {words} words, at most {most}"
    for name in ("RESULTS.md", "BENCHMARKS.md"):
        lines = (REPO / name).read_text().splitlines()
        headings = [i for i, line in enumerate(lines) if line.startswith("## ")]
        # the summary: everything before the first section that is not the summary itself
        end = next(i for i in headings if lines[i].strip() != "## Summary")
        assert end - 1 <= 40, f"{name}: a summary of {end - 1} lines"
