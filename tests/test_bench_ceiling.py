"""bench.ceiling's loop on a tiny checkpoint: every timed run is kept, and the ceiling it
reports is the best of them (what the loop can do; slower runs met first shapes or a busy
host)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as ckpt

from bench import ceiling


def test_the_ceiling_is_the_best_of_its_runs(tmp_path, capsys):
    model = ckpt.make_llama(tmp_path / "llama", num_hidden_layers=1)
    assert (
        ceiling.main(["--model", str(model), "--batch", "1,3", "--steps", "4", "--repeats", "3"])
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for batch in ("1", "3"):
        runs = result["ceiling_runs"][batch]
        assert len(runs) == 3 and all(x > 0 for x in runs)
        assert result["ceiling"][batch] == max(runs)
