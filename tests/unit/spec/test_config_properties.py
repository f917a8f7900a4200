"""Property tests: mutated shipped policies and specs load, or fail with a file:line error.

Hypothesis rewrites values (types, durations, numbers, text), renames, repeats
and drops keys, damages YAML syntax, changes encodings and grows sizes; every
result must be a valid config or a ConfigError whose problems name the file
(with a line where one exists) - never another exception. Bounded
``max_examples`` keeps the whole module to a few seconds.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay.core.exceptions import ConfigError
from relay.core.settings import REPO_ROOT
from relay.policy.model import load_policy
from relay.spec.job import load_job_spec

SHIPPED = {
    "policy": [(REPO_ROOT / "policies" / n).read_text() for n in ("default.yaml", "strict.yaml")],
    "spec": [(REPO_ROOT / "dags" / "jobs" / "demo.yaml").read_text()],
}
VALUES = st.one_of(
    st.sampled_from(["", "~", "null", "true", "no", "-1", "0", "1e309", ".nan", "-3s", "30x",
                     "5m", "1h30m", "500ms", "[1, 2]", "{a: 1}", "'quoted'", "&a 1", "*a",
                     "!!binary aGk=", "!!python/object:os.system x", "retry", "abort",
                     "http://h/x", "ftp://h", "99999999999999999999999", "\t1", "{", "]"]),
    st.integers(-10**6, 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=12),
)
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def mutated(draw: st.DrawFn, kind: str) -> bytes:
    text = draw(st.sampled_from(SHIPPED[kind]))
    lines = text.splitlines()
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(lines) - 1))
        line = lines[i]
        op = draw(st.sampled_from(["value", "value", "key", "repeat", "drop", "indent", "raw"]))
        key, sep, _rest = line.partition(":")
        if op == "value" and sep:
            lines[i] = f"{key}: {draw(VALUES)}"
        elif op == "key" and sep:
            lines[i] = f"{key[: len(key) - len(key.lstrip())]}{draw(st.text(max_size=8))}:{_rest}"
        elif op == "repeat":
            lines.insert(i, line)
        elif op == "drop":
            del lines[i]
        elif op == "indent":
            lines[i] = draw(st.sampled_from(["", " ", "\t", "    "])) + line.lstrip()
        else:
            lines[i] = draw(st.text(max_size=30))
        if not lines:
            lines = [""]
    body = "\n".join(lines) * draw(st.sampled_from([1, 1, 1, 2, 8]))
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-16", "latin-1"]))
    data = body.encode(encoding, errors="replace")
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return data


def check(load, data: bytes) -> None:  # noqa: ANN001 - a loader
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_bytes(data)
        try:
            load(path)
        except ConfigError as err:
            assert err.problems, "a ConfigError must list its problems"
            for problem in err.problems:
                assert problem.file == str(path)
                assert problem.line is None or 1 <= problem.line
                assert problem.expected and problem.fix
            assert str(err).startswith(str(path))


@SETTINGS
@given(mutated("policy"))
def test_mutated_policies_are_valid_or_a_file_line_error(data: bytes) -> None:
    check(load_policy, data)


@SETTINGS
@given(mutated("spec"))
def test_mutated_specs_are_valid_or_a_file_line_error(data: bytes) -> None:
    check(load_job_spec, data)
