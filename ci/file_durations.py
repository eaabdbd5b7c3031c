"""Writes tests/file_durations.json, each test file's seconds in a run, from that run's JUnit XML.

    python -m pytest -n 2 --dist loadfile -m "not extended" --junitxml=run.xml
    python ci/file_durations.py run.xml

tests/conftest.py hands the files to the workers longest first (a file's time includes its fixtures' setup)."""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import xml.etree.ElementTree as ElementTree

OUTPUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "file_durations.json"
MIN_SECONDS = 3.0  # shorter files go after the listed ones, by their number of tests


def file_seconds(junit_xml: pathlib.Path) -> dict[str, float]:
    """Seconds per test file (tests/...py), longest first, from the testcases' class names."""
    seconds: collections.Counter[str] = collections.Counter()
    for case in ElementTree.parse(junit_xml).iter("testcase"):
        module = case.get("classname", "")
        # a class inside the module adds a part: keep the parts up to the test_ module
        parts = module.split(".")
        ends = [i for i, part in enumerate(parts) if part.startswith("test_")]
        if not ends:
            continue
        seconds["/".join(parts[:ends[0] + 1]) + ".py"] += float(case.get("time", 0.0))
    return {name: round(value, 1) for name, value in seconds.most_common() if value >= MIN_SECONDS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit_xml", type=pathlib.Path, help="the run's --junitxml file")
    args = parser.parse_args()
    durations = file_seconds(args.junit_xml)
    OUTPUT.write_text(json.dumps(durations, indent=0) + "\n")
    print(f"{OUTPUT}: {len(durations)} files, {sum(durations.values()):.0f} s")


if __name__ == "__main__":
    main()
