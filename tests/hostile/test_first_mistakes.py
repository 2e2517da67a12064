"""The mistakes a new user makes on the first run -- a file path that is wrong or a file not made yet, an
algorithm's name misspelt, a cost file of another pipeline's pp -- each end with one clear line that names
what to do: the command that makes the file, the names there are, the shape the file is for."""

import pytest

from hostile_support import refused, run_cli


def _measured_at_pp4(folder):
    path = folder / "measured.yaml"
    path.write_text("# primuspipe cost model measured from 1f1b pp=4 vpp=1 m=8\n"
                    "compute: {f: [1, 1, 1, 1], b: [1, 1, 1, 1], w: [1, 1, 1, 1]}\n")
    return path


@pytest.mark.parametrize("case, argv, names", [
    ("cost file not made yet", ["simulate", "-a", "zbv", "--pp", "4", "-m", "8", "--cost", "my_cost.yaml"],
     ["my_cost.yaml", "does not exist", "primuspipe calibrate"]),
    ("schedule file mistyped", ["validate", "1f1b.cvs"], ["1f1b.cvs", "does not exist", "primuspipe export"]),
    ("dump folder mistyped", ["vis", "pp_dat"], ["pp_dat", "does not exist", "dump directory"]),
    ("dump folder mistyped, calibrate", ["calibrate", "pp_dat"], ["pp_dat", "does not exist", "dump directory"]),
    ("algorithm misspelt", ["show", "zbx", "--pp", "4", "-m", "8"], ["zbx", "registered: 1f1b", "zbv"]),
    ("algorithm misspelt, simulate", ["simulate", "-a", "zb_h1", "--pp", "4", "-m", "8"], ["zb_h1", "zb-h1"]),
    ("cost file of another pp", ["simulate", "-a", "zbv", "--pp", "8", "-m", "8", "--cost", "measured.yaml"],
     ["measured.yaml", "4 values each", "pp=8", "measured at"]),
    ("per-stage flag of another pp", ["simulate", "-a", "1f1b", "--pp", "4", "-m", "8", "--f", "1,2,3"],
     ["--f", "3 values", "one number or 4"]),
])
def test_first_mistake_is_one_line_with_the_fix(tmp_path, monkeypatch, case, argv, names):
    monkeypatch.chdir(tmp_path)
    _measured_at_pp4(tmp_path)
    outcome = refused(run_cli(argv), *names, case=case)
    assert "\n" not in outcome.message.strip(), outcome.message
