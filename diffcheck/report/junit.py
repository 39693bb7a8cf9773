"""The JUnit XML report, for CI systems that show test results.

Knows how to map verdicts onto JUnit's pass / failure / error; judges nothing.

Layout: one ``<testsuite>`` per case (``"{candidate_id} vs {reference_id}"``),
one ``<testcase>`` per sequence (``classname`` = the candidate id, ``name`` =
``"seq{index} {prompt_id}"``). Mapping:

- IDENTICAL, BENIGN_DRIFT: passed.
- WITHIN_BUDGET: passed, with the evidence in ``<system-out>``; a ``<failure>``
  instead when ``strict=True`` (the one policy, `diffcheck.core.types.passes`).
- INCONCLUSIVE: ``<skipped>`` (type INCONCLUSIVE, message = what would decide it),
  never "passed": JUnit counts it apart from passes and failures, and the command's
  exit code (4, or 0 with --allow-inconclusive: the one policy) is what gates CI. A
  skip and not a failure, because nothing was found wrong either: the sequence was
  not judged, as a test whose precondition is missing is not run.
- DEGRADED, GIBBERISH: ``<failure>``, message = the first evidence string.
- ERROR: ``<error>``, message = the first evidence string or the case's error.
  A case that is ERROR with no sequences (the engine never produced any) gets
  one testcase named ``engine`` carrying the error.

Suite ``<properties>`` hold the case verdict, the baselines and the config delta.
Control characters are shown as visible symbols so the XML stays well-formed.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Iterable

from diffcheck.report import atomic_write_text, case_baselines, config_delta_lines, printable
from diffcheck.core.types import fails
from diffcheck.core.types import CaseVerdict, SequenceVerdict, Verdict


def _details(sequence: SequenceVerdict) -> str:
    lines = [
        f"verdict: {sequence.verdict.name}",
        f"t*: {sequence.t_star}  onset: {sequence.onset}  shared prefix: {sequence.shared_prefix}",
        f"tokens: reference {sequence.reference_len}, candidate {sequence.candidate_len}",
    ]
    lines += [f"evidence: {e}" for e in sequence.evidence]
    return printable("\n".join(lines))


def _message(sequence: SequenceVerdict, fallback: str) -> str:
    first = sequence.evidence[0] if sequence.evidence else fallback
    return printable(first)


def _testcase(parent: ET.Element, case: CaseVerdict, sequence: SequenceVerdict, *, strict: bool) -> str:
    """Append one testcase; returns its outcome: "passed", "skipped", "failure" or "error"."""
    element = ET.SubElement(
        parent,
        "testcase",
        classname=printable(case.candidate_id),
        name=printable(f"seq{sequence.index} {sequence.prompt_id}"),
        time="0",
    )
    verdict = sequence.verdict
    if verdict is Verdict.ERROR:
        child = ET.SubElement(
            element, "error", message=_message(sequence, case.error or "error"), type=verdict.name
        )
        child.text = _details(sequence)
        return "error"
    if verdict is Verdict.INCONCLUSIVE:
        child = ET.SubElement(element, "skipped", message=_message(sequence, verdict.name), type=verdict.name)
        child.text = _details(sequence)
        return "skipped"
    if fails(verdict, strict=strict):
        child = ET.SubElement(element, "failure", message=_message(sequence, verdict.name), type=verdict.name)
        child.text = _details(sequence)
        return "failure"
    if verdict is not Verdict.IDENTICAL:
        ET.SubElement(element, "system-out").text = _details(sequence)
    return "passed"


def _suite(root: ET.Element, case: CaseVerdict, *, strict: bool) -> dict[str, int]:
    suite = ET.SubElement(root, "testsuite", name=printable(f"{case.candidate_id} vs {case.reference_id}"))
    properties = ET.SubElement(suite, "properties")
    ET.SubElement(properties, "property", name="verdict", value=case.verdict.name)
    for name, passed in case_baselines(case).items():
        value = "n/a" if passed is None else ("pass" if passed else "fail")
        ET.SubElement(properties, "property", name=f"baseline.{name}", value=value)
    for line in config_delta_lines(case.config_delta):
        path, _, change = line.partition(": ")
        ET.SubElement(properties, "property", name=printable(f"config_delta.{path}"), value=printable(change))

    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    outcomes = [_testcase(suite, case, s, strict=strict) for s in case.sequences]
    if case.verdict is Verdict.ERROR and not case.sequences:
        element = ET.SubElement(suite, "testcase", classname=printable(case.candidate_id), name="engine", time="0")
        message = printable(case.error or "engine error")
        ET.SubElement(element, "error", message=message, type=Verdict.ERROR.name).text = message
        outcomes.append("error")
    counts["tests"] = len(outcomes)
    counts["failures"] = outcomes.count("failure")
    counts["errors"] = outcomes.count("error")
    counts["skipped"] = outcomes.count("skipped")
    suite.set("tests", str(counts["tests"]))
    suite.set("failures", str(counts["failures"]))
    suite.set("errors", str(counts["errors"]))
    suite.set("skipped", str(counts["skipped"]))
    suite.set("time", "0")
    return counts


def junit_tree(verdicts: Iterable[CaseVerdict], *, strict: bool = False, name: str = "diffcheck") -> ET.ElementTree:
    root = ET.Element("testsuites", name=name)
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for case in verdicts:
        for key, n in _suite(root, case, strict=strict).items():
            totals[key] += n
    for key, n in totals.items():
        root.set(key, str(n))
    return ET.ElementTree(root)


def write_junit(
    path: str | os.PathLike,
    verdicts: Iterable[CaseVerdict],
    *,
    strict: bool = False,
    name: str = "diffcheck",
) -> Path:
    """Write the JUnit XML atomically; returns the path."""
    return atomic_write_text(path, junit_text(verdicts, strict=strict, name=name))


def junit_text(verdicts: Iterable[CaseVerdict], *, strict: bool = False, name: str = "diffcheck") -> str:
    """The JUnit XML document, declaration included."""
    tree = junit_tree(verdicts, strict=strict, name=name)
    ET.indent(tree, space=" ")
    text = ET.tostring(tree.getroot(), encoding="unicode", xml_declaration=False)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + text + "\n"


def render_junit(result) -> str:
    """The registry's renderer: any result with verdicts (``verdicts``, ``strict``, ``junit_name``)."""
    return junit_text(result.verdicts, strict=result.strict, name=result.junit_name)
