"""bench/results.py: records on one line when they fit, nested otherwise, the same JSON data."""

from __future__ import annotations

import json
from pathlib import Path

from bench.results import FLAT_WIDTH, WIDTH, dumps, write_result

REPO = Path(__file__).resolve().parents[2]


def test_records_inline_when_they_fit_nested_otherwise(tmp_path: Path) -> None:
    small = {"step": 1, "reward": {"reverse": 0.5}, "ids": [1, 2, 3]}
    flat = {f"k{i}": "x" * 20 for i in range(12)}  # no nesting: one line up to FLAT_WIDTH
    nested_big = {"a": [{"s": "y" * (WIDTH // 2)}, {"s": "y" * (WIDTH // 2)}]}
    doc = {"command": "bench/x.py --out r.json", "history": [small] * 6, "flat": flat, "big": nested_big}
    assert WIDTH < len(json.dumps(flat)) <= FLAT_WIDTH and len(json.dumps(doc["history"])) > WIDTH
    text = dumps(doc)
    lines = text.splitlines()
    assert lines[0] == "{" and lines[1] == ' "command": "bench/x.py --out r.json",'
    assert f"  {json.dumps(small)}," in lines  # each record of the list on its own line, whole
    assert f' "flat": {json.dumps(flat)},' in lines
    assert ' "big": {' in lines and '  "a": [' in lines  # too long: nested a level down
    assert json.loads(text) == doc and text.endswith("}\n")
    out = write_result(tmp_path / "sub" / "r.json", {"p": Path("/x"), "t": (1, 2)}, default=str)
    assert json.loads(out.read_text()) == {"p": "/x", "t": [1, 2]}


def test_committed_result_file_is_in_this_style() -> None:
    path = REPO / "bench" / "calibration" / "results" / "inprocess_staleness.json"
    text = path.read_text()
    assert dumps(json.loads(text)) == text
