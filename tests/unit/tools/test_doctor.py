"""`relay doctor`: real checks on this CPU machine, and the GPU branches on a FAKE CUDA.

This machine has no GPU and a CPU-only torch. The doctor's run here is real:
two spawned processes all-reduce over gloo, a real HTTP server's Date header and
a real SQLite database are read for clock skew. Tests named ``*fake_cuda*``
monkeypatch ``torch.cuda.*`` / ``torch.distributed.is_nccl_available`` and a
fake nvidia-smi: they check the doctor's reasoning, not a GPU.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from local_http import serving

from relay.tools import cli, doctor
from relay.tools.doctor import Check, Status


def test_doctor_on_this_cpu_machine(capsys: pytest.CaptureFixture[str]) -> None:
    """Real: a 2-rank gloo all-reduce runs; no GPU is not a problem; exit code 0."""
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "ok    gloo all-reduce" in out and "summed to 3" in out
    assert "skip  gpus" in out and "skip  nccl all-reduce" in out
    assert out.rstrip().endswith("relay doctor: nothing needed is broken")


def test_allreduce_failure_is_reported_with_the_ranks_error() -> None:
    """Real: NCCL on this CPU-only torch fails in both ranks; the check says so and why."""
    check = doctor.check_allreduce("nccl", timeout_seconds=60)
    assert check.status is Status.FAIL
    assert "rank 0:" in check.detail and "rank 1:" in check.detail
    assert "cuda" in check.detail.lower()  # torch's own reason, passed on


def test_doctor_exits_1_and_prints_the_fix_when_something_is_broken(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = [Check("gpus", Status.OK, "fine"), Check("nccl", Status.FAIL, "gone", "install it")]
    monkeypatch.setattr(doctor, "run_checks", lambda **_: broken)
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  nccl  gone" in out and "fix: install it" in out
    assert "relay doctor: 1 problem(s) found" in out


# -- GPUs and NCCL on a FAKE CUDA -------------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torch believe in 2 H100s with NCCL 2.27.3 (nothing runs on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"NVIDIA H100 #{i}")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)


def smi_two() -> list[tuple[str, str]]:
    return [("NVIDIA H100", "570.86"), ("NVIDIA H100", "570.86")]


def test_gpus_on_fake_cuda(fake_cuda: None) -> None:
    check = doctor.check_gpus(2, smi=smi_two)
    assert check.status is Status.OK
    assert check.detail == ("2 GPU(s): NVIDIA H100 #0, NVIDIA H100 #1; CUDA 12.8; "
                            "driver 570.86")


def test_too_few_gpus_on_fake_cuda(fake_cuda: None) -> None:
    check = doctor.check_gpus(4, smi=smi_two)
    assert check.status is Status.FAIL
    assert "expected at least 4" in check.detail and "ranks_per_node to 2" in check.fix


def test_gpus_the_driver_sees_but_torch_cannot_use() -> None:
    """Real CPU-only torch, fake nvidia-smi: the classic "installed the CPU wheel" mistake."""
    check = doctor.check_gpus(0, smi=smi_two)
    assert check.status is Status.FAIL
    assert "nvidia-smi sees 2 GPU(s)" in check.detail and "CUDA build of torch" in check.fix


def test_required_gpus_on_this_machine_fail() -> None:
    assert doctor.check_gpus(1, smi=lambda: None).status is Status.FAIL


def test_nccl_on_fake_cuda(fake_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert doctor.check_nccl() == Check("nccl", Status.OK, "NCCL 2.27.3")
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert doctor.check_nccl().status is Status.FAIL


def test_two_fake_gpus_add_an_nccl_allreduce(fake_cuda: None, tmp_path: Path) -> None:
    ran: list[str] = []

    def allreduce(backend: str) -> Check:
        ran.append(backend)
        return Check(f"{backend} all-reduce", Status.OK, "recorded, not run")

    doctor.run_checks(allreduce=allreduce, tracking_uri=f"sqlite:///{tmp_path / 'x.db'}",
                      airflow_db=f"sqlite:///{tmp_path / 'none.db'}")
    assert ran == ["gloo", "nccl"]


# -- clock skew -------------------------------------------------------------------------


@pytest.fixture
def http_server() -> Iterator[tuple[str, dict[str, float]]]:
    """A real HTTP server on loopback whose Date header is shifted by ``shift['seconds']``."""
    shift = {"seconds": 0.0}

    class Handler(BaseHTTPRequestHandler):
        def date_time_string(self, timestamp: float | None = None) -> str:
            return formatdate(time.time() + shift["seconds"], usegmt=True)

        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *_: object) -> None:
            pass

    with serving(Handler) as url:
        yield url, shift


def test_clock_in_step_with_the_mlflow_server(
    http_server: tuple[str, dict[str, float]], tmp_path: Path
) -> None:
    url, _ = http_server
    mlflow, _ = doctor.check_clocks(2.0, url, f"sqlite:///{tmp_path / 'none.db'}")
    assert mlflow.status is Status.OK, mlflow
    assert f"HTTP Date of {url}/health" in mlflow.detail


def test_clock_skew_to_the_mlflow_server_fails(
    http_server: tuple[str, dict[str, float]], tmp_path: Path
) -> None:
    url, shift = http_server
    shift["seconds"] = -30.0
    mlflow, _ = doctor.check_clocks(2.0, url, f"sqlite:///{tmp_path / 'none.db'}")
    assert mlflow.status is Status.FAIL
    assert "offset -29." in mlflow.detail or "offset -30." in mlflow.detail
    assert "NTP" in mlflow.fix


def test_unreachable_mlflow_server_is_a_warning(tmp_path: Path) -> None:
    from relay.launchers.local.launcher import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    mlflow, _ = doctor.check_clocks(2.0, url, f"sqlite:///{tmp_path / 'none.db'}")
    assert mlflow.status is Status.WARN and "could not read the clock" in mlflow.detail


def test_airflow_sqlite_db_is_read_and_a_missing_one_is_not_created(tmp_path: Path) -> None:
    db = tmp_path / "airflow.db"
    _, missing = doctor.check_clocks(2.0, "sqlite:///m.db", f"sqlite:///{db}")
    assert missing.status is Status.SKIP and not db.exists()
    sqlite3.connect(db).close()
    _, airflow = doctor.check_clocks(2.0, "sqlite:///m.db", f"sqlite:///{db}")
    assert airflow.status is Status.OK, airflow
    assert "now() of the sqlite database" in airflow.detail


# -- rendezvous address and interfaces ----------------------------------------------------


def test_socket_interfaces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert doctor.check_socket_interfaces().status is Status.OK
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    check = doctor.check_socket_interfaces()
    assert check.status is Status.FAIL and "GLOO_SOCKET_IFNAME=nosuch0" in check.detail
    assert "lo" in check.detail
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "l")  # NCCL matches by prefix: "l" finds "lo"
    assert doctor.check_socket_interfaces().status is not Status.FAIL
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=l")  # "=" asks for the exact name
    assert doctor.check_socket_interfaces().status is Status.FAIL


def test_master_addr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert doctor.check_master_addr().status is Status.OK
    bad = doctor.check_master_addr("no-such-host.invalid")
    assert bad.status is Status.FAIL and "does not resolve" in bad.detail


def test_bad_max_skew_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--max-skew", "soon"]) == 2
    assert "relay doctor --max-skew: expected a duration" in capsys.readouterr().err
