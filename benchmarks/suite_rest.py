"""The test ids that an earlier, cut-short pytest run did not report, for ``gpu_check.sh``'s SUITE_REST.

    python benchmarks/suite_rest.py suite.log [tests]    # prints the missing node ids, space-separated

Collects ``tests`` (default ``tests``) with ``pytest --collect-only -q`` and leaves out every test the
earlier run reported (passed, failed, errored or skipped alike): from its verbose log (``-v``, whose
``PASSED tests/...::...`` lines are written as tests end, so a run cut short by a timeout has them), or
from a JUnit report (``.xml``, complete only when pytest ended by itself)."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET


def reported(xml_path: str) -> set[str]:
    """Node ids (``tests/test_x.py::test_y[param]``) of the JUnit report's test cases."""
    done = set()
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")  # tests.test_x or tests.test_x.TestClass
        path = "/".join(module[:2]) + ".py"
        name = "::".join(module[2:] + [case.get("name", "")])
        done.add(f"{path}::{name}")
    return done


def reported_in_log(log_path: str) -> set[str]:
    """Node ids on the verbose log's result lines: xdist's ``[gw0] [ 12%] PASSED tests/x.py::y``, or
    ``tests/x.py::y PASSED [ 12%]`` from one process."""
    outcome = "(?:PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
    # An id runs to the end of the line (xdist) or to its outcome: parameters may hold spaces.
    pattern = re.compile(rf"\b{outcome} (tests/.+?::.+?) *$|^(tests/.+?::.+?) {outcome}\b", re.MULTILINE)
    return {m.group(1) or m.group(2) for m in pattern.finditer(open(log_path, errors="replace").read())}


def shell_safe(nodes: list[str]) -> list[str]:
    """``nodes`` as words a shell passes on unquoted: an id whose parameters hold a space, a quote or a
    backslash becomes its test function's id (all its parameters run again), once."""
    out: list[str] = []
    for node in nodes:
        if re.search(r"[\s'\"\\$`]", node):
            node = node.split("[", 1)[0]
        if node not in out:
            out.append(node)
    return out


def main() -> None:
    xml_path, target = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "tests")
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", target],
                         capture_output=True, text=True)
    collected = [line.strip() for line in out.stdout.splitlines() if "::" in line]
    done = reported(xml_path) if xml_path.endswith(".xml") else reported_in_log(xml_path)
    rest = [node for node in collected if node not in done]
    if not collected:
        sys.exit(f"collected nothing from {target}: {out.stderr.strip()[-300:]}")
    print(" ".join(shell_safe(rest)))  # nothing when the report has them all


if __name__ == "__main__":
    main()
