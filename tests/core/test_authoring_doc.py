"""docs/authoring.md's example runs as written."""

import re
from pathlib import Path


from primuspipe.cli import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "authoring.md"


def test_authoring_example_runs(clean_registry, tmp_path, capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    out = tmp_path / "eager.csv"
    assert main(["export", "eager-1f1b", "--pp", "4", "-m", "8", "-O", "extra_warmup=2", "--format", "csv", "-o", str(out)]) == 0
    assert main(["validate", str(out)]) == 0
    assert main(["show", "eager-1f1b", "--pp", "4", "-m", "8", "-O", "extra_warmup=0.5"]) == 1
    assert "extra_warmup must be >= 1" in capsys.readouterr().err
