"""Every figure the README's performance table quotes is a value of the record case its row
names in ops/bench/results/ (as shown: rounded to the digits written, a share as a percentage),
so the front page cannot drift from the measurements."""

import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "ops", "bench", "results")
ROW = re.compile(r"^\| (?P<what>[^|]+) \| (?P<figure>[^|]+) \| `(?P<record>[^`]+)`: `(?P<case>[^`]+)` \|$")
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def _rows() -> list[dict[str, str]]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("\n## Performance\n", 1)[1].split("\n## ", 1)[0]
    return [m.groupdict() for line in section.splitlines() if (m := ROW.match(line))]


def _values(node) -> list[float]:
    if isinstance(node, dict):
        return [v for child in node.values() for v in _values(child)]
    if isinstance(node, list):
        return [v for child in node for v in _values(child)]
    return [float(node)] if isinstance(node, (int, float)) and not isinstance(node, bool) else []


def _shown(token: str, value: float) -> bool:
    digits = len(token.split(".")[1]) if "." in token else 0
    number = float(token.replace(",", ""))
    return any(round(v, digits) == number for v in (value, 100 * value))


def test_the_performance_table_has_rows():
    assert len(_rows()) >= 10


def test_every_quoted_figure_is_in_the_record_case_its_row_names():
    for row in _rows():
        path = os.path.join(RESULTS, f"{row['record']}.json")
        assert os.path.isfile(path), f"README row {row['what']!r}: no record {row['record']}"
        with open(path, encoding="utf-8") as f:
            figures = json.load(f)["figures"]
        assert row["case"] in figures, f"README row {row['what']!r}: {row['record']} has no case {row['case']}"
        values = _values(figures[row["case"]])
        for token in NUMBER.findall(row["figure"]):
            assert any(_shown(token, v) for v in values), (
                f"README row {row['what']!r}: {token} is not a figure of {row['record']} {row['case']}: {values}"
            )
