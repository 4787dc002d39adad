"""benchmarks/notebooks_gpu.py's command line: a notebook number that names no notebook is
refused before anything runs (a short device lease must not spend itself on a typo), and
each notebook gets the parameters its GPU run needs."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import notebooks_gpu  # noqa: E402


def test_unknown_notebook_number_is_refused_with_the_allowed_ones(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        notebooks_gpu.main(["--only", "09,1", "--out", str(tmp_path), "--ckpt", str(tmp_path / "ckpt")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--only 1: no such notebook" in err and "01,02,03,04,05,06,07,08,09" in err
    assert not (tmp_path / "ckpt").exists(), "a checkpoint was written before the bad argument was refused"


def test_parameters_per_notebook():
    gpu = {"DEVICE": "nvidia", "DTYPE": "bfloat16"}
    assert notebooks_gpu.params_for("01_quickstart", "/m", 1) == {"MODEL": "/m", **gpu}
    assert notebooks_gpu.params_for("09_serving_under_load", "/m", 1) == {"MODEL": "/m", **gpu}
    assert notebooks_gpu.params_for("04_speculative_tuning", "/m", 1) == gpu
    assert notebooks_gpu.params_for("05_expert_placement", "/m", 1) == {}, "one GPU: 05's ranks stay on gloo"
    assert notebooks_gpu.params_for("05_expert_placement", "/m", 2) == gpu
    assert notebooks_gpu.params_for("01_quickstart", "/m", 1, smoke=True) == {"MODEL": "/m", "DEVICE": "cpu",
                                                                               "DTYPE": "float32"}
