"""bench.report.write_results: OUT.json and OUT.md beside each other, the name's dots kept (no
``Path.with_suffix``), a missing folder made, only the JSON without a table."""

import json

from bench import report


def test_writes_both_beside_a_dotted_name_in_a_new_folder(tmp_path):
    out = tmp_path / "new" / "deeper" / "gpu-h100.s45"
    report.write_results(out, {"rows": [1, 2]}, "| a |\n")
    assert json.loads((tmp_path / "new" / "deeper" / "gpu-h100.s45.json").read_text()) == {
        "rows": [1, 2]
    }
    assert (tmp_path / "new" / "deeper" / "gpu-h100.s45.json").read_text().endswith("]\n}\n")
    assert (tmp_path / "new" / "deeper" / "gpu-h100.s45.md").read_text() == "| a |\n"
    assert sorted(p.name for p in out.parent.iterdir()) == ["gpu-h100.s45.json", "gpu-h100.s45.md"]


def test_only_the_json_without_markdown(tmp_path):
    report.write_results(str(tmp_path / "r"), {"x": 1}, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
    assert (tmp_path / "r.json").read_text() == '{\n "x": 1\n}\n'
