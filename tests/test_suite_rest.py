"""``benchmarks/suite_rest.py`` (the GPU check's second call runs the tests the first did not reach):
ids read from a cut-short verbose log, parameters with spaces included, and passed on as shell words."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from suite_rest import reported_in_log, shell_safe  # noqa: E402


def test_ids_with_spaces_are_read_whole_from_xdist_and_single_process_logs(tmp_path):
    log = tmp_path / "suite.log"
    log.write_text("[gw0] [ 12%] PASSED tests/test_a.py::test_x[no answer here-None] \n"
                   "[gw3] [ 13%] FAILED tests/test_b.py::test_y \n"
                   "tests/test_c.py::test_z[a b] SKIPPED (needs rapidocr) [ 14%]\n"
                   "tests/test_c.py::test_w PASSED [ 15%]\n"
                   "INTERNALERROR> KeyboardInterrupt\n")
    assert reported_in_log(str(log)) == {"tests/test_a.py::test_x[no answer here-None]", "tests/test_b.py::test_y",
                                         "tests/test_c.py::test_z[a b]", "tests/test_c.py::test_w"}


def test_ids_a_shell_would_split_become_their_functions_once():
    assert shell_safe(["tests/t.py::f[1]", "tests/t.py::g[a b]", "tests/t.py::g[c d]", "tests/t.py::h['x']",
                       "tests/t.py::k"]) == ["tests/t.py::f[1]", "tests/t.py::g", "tests/t.py::h", "tests/t.py::k"]
