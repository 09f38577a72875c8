"""``flash_recipe.atomic_json.write_json``: the one atomic JSON writer (tuned cache, bench, campaign)."""

from __future__ import annotations

import json

import pytest

from flash_recipe.atomic_json import write_json


def test_write_json_replaces_the_file_whole_and_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / "report.json"
    write_json(path, {"rows": [1, 2]})
    write_json(str(path), {"rows": [3]})
    assert json.loads(path.read_text()) == {"rows": [3]}
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    path = tmp_path / "cache.json"
    write_json(path, {"format": 1})
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_json(path, {"format": 2, "bad": object()})
    assert json.loads(path.read_text()) == {"format": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["cache.json"]
