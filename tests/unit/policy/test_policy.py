"""Unit tests for loading and validating the recovery policy's detection section."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import yaml
from policy_files import line_of, load_error

import relay.core.settings
from relay.core.faults import FaultKind
from relay.policy.model import Detection, load_policy
from relay.watch.detection import Detector
from relay.watch.observation import Observation
from relay_train.protocol.heartbeat import Heartbeat, Phase

REPO = Path(relay.core.settings.REPO_ROOT)
DEFAULT = REPO / "policies" / "default.yaml"
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

# A complete, valid ``rules:`` section (one rule per fault kind), appended at the END of
# every tmp policy so that the line numbers of the keys under test do not move.
RULES = """\
rules:
  hang:                {action: restart_elsewhere, max_attempts: 3, backoff: 1s, quarantine: 30m}
  rank_unresponsive:   {action: restart_elsewhere, max_attempts: 3, backoff: 1s, quarantine: 30m}
  node_unresponsive:   {action: restart_elsewhere, max_attempts: 3, backoff: 1s, quarantine: 1h}
  straggler:           {action: checkpoint_and_migrate, max_attempts: 3, quarantine: 30m}
  throughput_degraded: {action: checkpoint_and_migrate, max_attempts: 2}
  crash:               {action: retry, max_attempts: 3, backoff: {initial: 1s, multiplier: 2}}
  launch_failure:      {action: restart_elsewhere, max_attempts: 2, quarantine: 15m}
  nan_loss:            {action: rollback, max_attempts: 2}
  corrupt_checkpoint:  {action: rollback, max_attempts: 2}
  short_segment:       {action: abort}
  preempted:           {action: checkpoint_and_migrate, max_attempts: 5}
"""


def seconds(text: object) -> float:
    """Independently convert a simple "<number><unit>" duration (or a number) to seconds."""
    if isinstance(text, int | float):
        return float(text)
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(text))
    assert match, f"test helper cannot read {text!r}"
    return float(match[1]) * _UNITS[match[2]]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return path


# -- the shipped default ---------------------------------------------------------


def test_default_policy_loads_with_durations_in_seconds() -> None:
    loaded = load_policy(DEFAULT)
    raw = yaml.safe_load(DEFAULT.read_text())["detection"]
    det = loaded.policy.detection

    assert loaded.path == DEFAULT
    assert loaded.policy.version == 1
    for key in ("poll_interval", "startup_timeout", "heartbeat_timeout", "hang_timeout",
                "checkpoint_timeout"):
        value = getattr(det, key)
        assert isinstance(value, float)
        assert value == pytest.approx(seconds(raw[key])), key
    assert det.startup_timeout == pytest.approx(120.0)  # "2m" really means minutes
    assert det.straggler is not None and det.throughput is not None
    assert det.straggler.ratio == raw["straggler"]["ratio"]
    assert det.straggler.sustained == pytest.approx(seconds(raw["straggler"]["sustained"]))
    assert det.throughput.floor == raw["throughput"]["floor"]
    assert det.throughput.sustained == pytest.approx(seconds(raw["throughput"]["sustained"]))
    assert det.throughput.baseline == pytest.approx(seconds(raw["throughput"]["baseline"]))
    assert det.throughput.warmup_steps == raw["throughput"]["warmup_steps"]
    assert det.nan_loss is raw["nan_loss"]


def test_default_policy_sha256_is_of_the_file_bytes() -> None:
    loaded = load_policy(DEFAULT)
    assert loaded.sha256 == hashlib.sha256(DEFAULT.read_bytes()).hexdigest()


def test_sha256_changes_with_the_file_even_if_the_policy_does_not(tmp_path: Path) -> None:
    text = DEFAULT.read_text()
    a = load_policy(write(tmp_path, text))
    b = load_policy(write(tmp_path, text + "# a comment\n"))
    assert a.policy == b.policy
    assert a.sha256 != b.sha256


def test_compound_and_plain_durations(tmp_path: Path) -> None:
    path = write(tmp_path, "detection:\n  startup_timeout: 1m30s\n  poll_interval: 250ms\n"
                           "  hang_timeout: 4\n  straggler:\n    sustained: 1.5s\n" + RULES)
    det = load_policy(path).policy.detection
    assert det.startup_timeout == pytest.approx(90.0)
    assert det.poll_interval == pytest.approx(0.25)
    assert det.hang_timeout == pytest.approx(4.0)
    assert det.straggler is not None and det.straggler.sustained == pytest.approx(1.5)


def test_rules_helper_is_a_complete_valid_rules_section(tmp_path: Path) -> None:
    """The RULES block used below must load on its own, with every fault kind covered."""
    loaded = load_policy(write(tmp_path, RULES)).policy
    assert loaded.detection == Detection()
    assert {k.value for k in FaultKind} == set(yaml.safe_load(RULES)["rules"])


def test_policy_without_rules_is_rejected_with_a_fix(tmp_path: Path) -> None:
    error = load_error(write(tmp_path, "version: 1\ndetection: {}\n"))
    assert [p.field for p in error.problems] == ["rules"]
    assert "expected this field to be set" in str(error)
    assert "rules:" in error.problems[0].fix


# -- bad policies -----------------------------------------------------------------


def policy(detection: str) -> str:
    """Return a policy whose detection section has the given (indented) lines, then RULES."""
    body = "\n".join(f"  {line}" for line in detection.strip("\n").splitlines())
    return f"# governance-owned\nversion: 1\ndetection:\n  poll_interval: 0.5s\n{body}\n{RULES}"


BAD = [
    pytest.param("hang_timeout: -1s", "hang_timeout", "detection.hang_timeout",
                 ["not negative", "'-1s'"], "hang_timeout: 3s", id="negative-hang-timeout"),
    pytest.param("hang_timeout: -2", "hang_timeout", "detection.hang_timeout",
                 ["not negative"], "hang_timeout: 3s", id="negative-number"),
    pytest.param("hang_timeout: 0s", "hang_timeout", "detection.hang_timeout",
                 ["> 0", "'0s'"], "hang_timeout: 3s", id="zero-hang-timeout"),
    pytest.param("heartbeat_timeout: 0", "heartbeat_timeout", "detection.heartbeat_timeout",
                 ["> 0"], "heartbeat_timeout: 2s", id="zero-heartbeat-timeout"),
    pytest.param("startup_timeout: soon", "startup_timeout", "detection.startup_timeout",
                 ["a duration such as", "'soon'"], "startup_timeout: 2m", id="unparseable"),
    pytest.param("hang_timeout: 3 seconds", "hang_timeout", "detection.hang_timeout",
                 ["a duration such as", "'3 seconds'"], "hang_timeout: 3s", id="spelled-out"),
    pytest.param("straggler:\n  ratio: 1.0", "ratio", "detection.straggler.ratio",
                 ["> 1", "1.0"], "ratio: 1.5", id="straggler-ratio-1"),
    pytest.param("straggler:\n  ratio: 0.5", "ratio", "detection.straggler.ratio",
                 ["> 1", "0.5"], "ratio: 1.5", id="straggler-ratio-below-1"),
    pytest.param("straggler:\n  sustained: 3s\n  lost_seconds: 0s", "lost_seconds",
                 "detection.straggler.lost_seconds", ["a duration > 0", "0s"],
                 "lost_seconds: 1s", id="straggler-lost-seconds-0"),
    pytest.param("straggler:\n  lost_seconds: a while", "lost_seconds",
                 "detection.straggler.lost_seconds", ["a duration such as", "'a while'"],
                 "lost_seconds", id="straggler-lost-seconds-unparseable"),
    pytest.param("throughput:\n  floor: 1.0", "floor", "detection.throughput.floor",
                 ["< 1", "1.0"], "floor: 0.6", id="throughput-floor-1"),
    pytest.param("throughput:\n  floor: 1.5", "floor", "detection.throughput.floor",
                 ["< 1", "1.5"], "floor: 0.6", id="throughput-floor-above-1"),
    pytest.param("hang_timout: 3s", "hang_timout", "detection.hang_timout",
                 ["no such field", "hang_timeout"], "rename `hang_timout` to `hang_timeout`",
                 id="misspelt-key"),
    pytest.param("colour: blue", "colour", "detection.colour",
                 ["no such field"], "remove `colour`", id="unknown-key"),
]


@pytest.mark.parametrize(("lines", "key", "field", "expected", "fix"), BAD)
def test_bad_policy_names_file_line_and_fix(
    tmp_path: Path, lines: str, key: str, field: str, expected: list[str], fix: str
) -> None:
    path = write(tmp_path, policy(lines))
    error = load_error(path)
    text = str(error)

    assert error.file == str(path)
    assert len(error.problems) == 1, text
    problem = error.problems[0]
    assert problem.field == field
    assert problem.line == line_of(path, key)
    assert f"{path}:{problem.line}: {field}: expected" in text
    for part in expected:
        assert part in text, f"{part!r} not in {text!r}"
    assert "Fix: " in text and fix in problem.fix, problem.fix


def test_many_problems_are_reported_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, policy(
        "hang_timeout: -1s\n"
        "startup_timeout: later\n"
        "hang_timout: 3s\n"
        "straggler:\n  ratio: 1.0\n"
        "throughput:\n  floor: 1.0\n"
    ))
    error = load_error(path)
    text = str(error)

    assert text.splitlines()[0] == f"{path}: 5 problems"
    got = {p.field: p.line for p in error.problems}
    assert got == {
        "detection.hang_timeout": line_of(path, "hang_timeout"),
        "detection.startup_timeout": line_of(path, "startup_timeout"),
        "detection.hang_timout": line_of(path, "hang_timout"),
        "detection.straggler.ratio": line_of(path, "ratio"),
        "detection.throughput.floor": line_of(path, "floor"),
    }
    for problem in error.problems:
        assert f"{path}:{problem.line}: {problem.field}" in text
        assert problem.fix


@pytest.mark.parametrize("null", ["null", "~", ""])
def test_null_straggler_section_turns_the_rule_off(tmp_path: Path, null: str) -> None:
    det = load_policy(write(tmp_path, policy(f"straggler: {null}".rstrip()))).policy.detection
    assert det.straggler is None
    assert det.throughput is not None  # only the nulled rule is off
    assert det == Detection(poll_interval=0.5, straggler=None)

    # ... and a detector built from it never reports a straggler, where the default does.
    detector, control = Detector(det), Detector(Detection())
    controls = []
    for i in range(40):
        now = 1000.0 + 0.5 * i
        beats = {
            r: Heartbeat(rank=r, node="node-a" if r < 2 else "node-b", pid=r, step=i,
                         phase=Phase.COMPUTE.value, phase_started_at=now - 0.1,
                         compute_seconds=1.0 if r == 3 else 0.1, wall_clock=now)
            for r in range(4)
        }
        obs = Observation(now=now, launched_at=now - 10.0, heartbeats=beats,
                          node_ranks={"node-a": [0, 1], "node-b": [2, 3]}, heartbeat_interval=0.5)
        assert detector.check(obs) is None
        controls.append(control.check(obs))
    assert any(f is not None and f.kind is FaultKind.STRAGGLER for f in controls)


def test_empty_detection_section_uses_defaults(tmp_path: Path) -> None:
    det = load_policy(write(tmp_path, "version: 1\ndetection: {}\n" + RULES)).policy.detection
    assert det == Detection()


def test_a_sustained_below_the_default_lost_seconds_survives_the_watchers_round_trip() -> None:
    """The trigger carries the detection section as a dict and validates it again: a
    policy with straggler.sustained 1s (below the 1 s lost_seconds default) must load."""
    from relay.policy.model import Detection, StragglerDetection

    detection = Detection(straggler=StragglerDetection(sustained=1.0))
    assert Detection.model_validate(detection.model_dump()) == detection
    assert StragglerDetection(sustained=3.0, lost_seconds=5.0).lost_seconds == 5.0
