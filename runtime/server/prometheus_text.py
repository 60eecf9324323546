"""Reading the Prometheus text exposition format (the text a /metrics endpoint answers with): the
router sums its upstreams' figures from it (runtime/router.py) and the harness reads a server's
gauges and counters from it (canary/targets.py); this is the one parser both use.

A sample is found by its exact name: the name as it appears on the line, so a counter `foo` is read
as `foo_total` and a histogram as `foo_bucket`/`foo_sum`/`foo_count`. A name is never matched as a
substring, which would let `dsv4_kv_pages_in_use` also match the router's
`dsv4_pd_upstream_kv_pages_in_use`.

prometheus_client has a parser too, but one line it cannot read fails the whole text, and the harness
reads the /metrics of servers that are not ours: here a malformed line is skipped, the rest still read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# A label value is quoted and may hold commas, braces and escaped quotes, so the label set cannot be
# split on "," or cut at the first "}".
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,?)')
_CLOSE = re.compile(r"\s*}")
_ESCAPE = re.compile(r"\\(.)")


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


def parse_samples(text: str) -> list[Sample]:
    """The samples of an exposition, in order; comments and lines that do not parse are left out."""
    samples = []
    for line in text.splitlines():
        sample = _parse_line(line.strip())
        if sample is not None:
            samples.append(sample)
    return samples


def sample_sum(samples: Iterable[Sample], name: str, labels: Mapping[str, str] | None = None) -> float | None:
    """The sum of the samples named exactly `name` whose labels include `labels` (all of them without
    `labels`: the total of a labelled counter); None when there is none, which a caller tells from 0."""
    values = [s.value for s in samples if s.name == name and (not labels or labels.items() <= s.labels.items())]
    return sum(values) if values else None


def _parse_line(line: str) -> Sample | None:
    if not line or line.startswith("#"):
        return None
    name = _NAME.match(line)
    if name is None:
        return None
    rest = line[name.end():].lstrip()
    labels: dict[str, str] = {}
    if rest.startswith("{"):
        pos = 1
        while (label := _LABEL.match(rest, pos)) is not None:
            labels[label[1]] = _ESCAPE.sub(_unescape, label[2])
            pos = label.end()
            if not label[3]:
                break
        close = _CLOSE.match(rest, pos)
        if close is None:
            return None
        rest = rest[close.end():]
    # After the value: an optional timestamp, which no reader here needs (a figure is read when it is
    # fetched), then in OpenMetrics an optional exemplar after "#" (no "#" is left outside the labels).
    fields = rest.partition("#")[0].split()
    if not fields or len(fields) > 2:
        return None
    try:
        value = float(fields[0])
        if len(fields) == 2:
            float(fields[1])
    except ValueError:
        return None
    return Sample(name[0], labels, value)


def _unescape(escape: re.Match) -> str:
    return "\n" if escape[1] == "n" else escape[1]
