"""Policies and specs cannot say one thing and mean another: duplicate keys, webhook URLs."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.core.exceptions import ConfigError
from relay.core.settings import REPO_ROOT
from relay.policy.explain import explain
from relay.policy.model import load_policy
from relay.spec.job import load_job_spec

DEFAULT = (REPO_ROOT / "policies" / "default.yaml").read_text()
DEMO = (REPO_ROOT / "dags" / "jobs" / "demo.yaml").read_text()


def with_line_after(text: str, anchor: str, extra: str) -> tuple[str, int]:
    """Insert ``extra`` after the first line starting with ``anchor``; return text, its line."""
    lines = text.splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith(anchor))
    lines.insert(index + 1, extra)
    return "\n".join(lines) + "\n", index + 2


def test_a_key_given_twice_in_a_policy_names_both_lines(tmp_path: Path) -> None:
    text, again = with_line_after(DEFAULT, "    max_attempts: 3", "    max_attempts: 9")
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_policy(path)
    (problem,) = err.value.problems
    assert (problem.line, problem.field) == (again, "rules.hang.max_attempts")
    assert f"on line {again - 1} and again on line {again}" in problem.found


def test_a_key_given_twice_in_a_spec_names_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "demo.yaml"
    path.write_text(DEMO + "total_steps: 9999\n")
    with pytest.raises(ConfigError) as err:
        load_job_spec(path)
    first = next(i for i, line in enumerate(DEMO.splitlines(), 1) if line.startswith("total_"))
    last = len(DEMO.splitlines()) + 1
    assert f"{path}:{last}: total_steps:" in str(err.value)
    assert f"on line {first} and again on line {last}" in str(err.value)


def test_the_same_key_in_different_mappings_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(DEFAULT)
    assert load_policy(path).policy.rules.hang.max_attempts == 3


@pytest.mark.parametrize("url", ["ftp://hooks.example.com/x", "hooks.example.com/x",
                                 "file:///etc/passwd", "http://", "https://h:notaport/x"])
def test_a_webhook_that_is_not_http_is_an_error_at_its_line(tmp_path: Path, url: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(DEFAULT.replace("  webhook: null", f"  webhook: '{url}'"))
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if "webhook:" in t)
    with pytest.raises(ConfigError) as err:
        load_policy(path)
    assert f"{path}:{line}: escalation.webhook: expected an http(s) URL" in str(err.value)


def test_a_bad_webhook_error_and_explain_never_show_its_credentials(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(DEFAULT.replace("  webhook: null", "  webhook: ftp://bob:hunter2@h/x?t=zz"))
    with pytest.raises(ConfigError) as err:
        load_policy(path)
    assert "hunter2" not in str(err.value) and "zz" not in str(err.value)
    path.write_text(DEFAULT.replace("  webhook: null", "  webhook: https://bob:hunter2@h/x?t=zz"))
    text = explain(load_policy(path))
    assert "POSTed to https://h/x?..." in text and "hunter2" not in text


def test_escalation_can_name_an_airflow_connection_but_not_also_a_webhook(
    tmp_path: Path,
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(DEFAULT.replace("  webhook: null", "  connection: relay_oncall"))
    assert load_policy(path).policy.escalation.connection == "relay_oncall"
    assert "Airflow connection relay_oncall" in explain(load_policy(path))
    path.write_text(DEFAULT.replace("  webhook: null",
                                    "  webhook: https://h/x\n  connection: relay_oncall"))
    with pytest.raises(ConfigError, match="expected either webhook or connection"):
        load_policy(path)
