"""``primuspipe calibrate A B ...`` over several runs: one run given twice under any spelling (the same path, a link,
``..``, a trailing slash) and runs of different shapes (pp, algorithm). Each is one line naming the inputs.

Defects this family found: a run given twice was measured twice, weighing double in every median and in the
screening of outlier runs (calibrate ran); runs of different shapes were refused without naming which inputs."""

import os

import pytest

from hostile_support import make_dump, refused, run_cli


def _twin(tmp_path, spelling):
    run = make_dump(tmp_path / "a", iterations=(0, 1, 2))
    if spelling == "link":
        (tmp_path / "link").symlink_to(run)
        return run, tmp_path / "link"
    return run, {"same": run, "dotdot": run / ".." / "a", "slash": f"{run}{os.sep}",
                 "relative": os.path.relpath(run)}[spelling]


@pytest.mark.parametrize("spelling", ["same", "link", "dotdot", "slash", "relative"])
@pytest.mark.parametrize("between", [False, True])
def test_a_run_given_twice(tmp_path, spelling, between):
    run, again = _twin(tmp_path, spelling)
    other = [make_dump(tmp_path / "b", iterations=(0, 1, 2), run_id="run-b", t0=5000.0)] if between else []
    refused(run_cli(["calibrate", run, *other, again, "-o", tmp_path / "c.yaml"], watch=tmp_path), "given again",
            case=f"calibrate a run twice ({spelling}{', another between' if between else ''})", before_work=True)


@pytest.mark.parametrize("other", [dict(pp=2), dict(algorithm="zb-h1")], ids=str)
def test_runs_of_different_shapes(tmp_path, other):
    a = make_dump(tmp_path / "a", iterations=(0, 1))
    b = make_dump(tmp_path / "b", iterations=(0, 1), run_id="run-b", **other)
    refused(run_cli(["calibrate", a, b, "-o", tmp_path / "c.yaml"], watch=tmp_path), str(a), str(b),
            case=f"calibrate runs of different shapes {other}", before_work=True)
