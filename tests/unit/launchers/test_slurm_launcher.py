"""The Slurm launcher without Slurm: its parsing of Slurm's output (lines captured from the
test bed's Slurm 22.05), node health, the batch script, the fence, stop, quarantines."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from relay.core.attempt import Attempt
from relay.launchers import launcher_for, launcher_from
from relay.launchers.agent_client import AgentChannel, NodeReport
from relay.launchers.base import Notice
from relay.launchers.slurm import commands
from relay.launchers.slurm.commands import (
    Slurm,
    SlurmError,
    SlurmJob,
    expand_hostlist,
    parse_job,
    parse_node,
)
from relay.launchers.slurm.launcher import (
    HANDLE_FILE,
    SlurmLauncher,
    batch_script,
    job_name,
    node_status,
)
from relay.nodes.pool import Quarantine
from relay.spec.job import load_job_spec
from relay.spec.slurm import SlurmSpec
from relay_train.agent.unpack import unpack
from relay_train.protocol.env import ENV_LAUNCH_B64, ENV_SHIELD_RANKS
from relay_train.protocol.launch import FIRST_STEP_FILE, LAUNCH_FILE, LaunchConfig
from relay_train.protocol.routes import (
    AGE_SECONDS,
    DRAIN_SECONDS,
    FIRST_STEP,
    GRACE_SECONDS,
    PREEMPTED,
    NodeState,
)

JOB_RUNNING = (
    "JobId=1 JobName=relay-x UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 "
    "Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 "
    "Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:02 TimeLimit=UNLIMITED "
    "Partition=main AllocNode:Sid=localhost:2519 ReqNodeList=node[1,3] ExcNodeList=(null) "
    "NodeList=node[1,3] BatchHost=node1 NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 "
    "ReqB:S:C:T=0:0:*:* TRES=cpu=2,node=2,billing=2 Socks/Node=* NtasksPerN:B:S:C=1:0:*:* "
    "Command=/tmp/sx.sh WorkDir=/ Comment=a/b/segment-000/try-0  StdErr=/dev/null "
    "StdIn=/dev/null StdOut=/dev/null Power= ")
NODE_DRAINED = (
    "NodeName=node2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=1 CPUTot=1 "
    "AvailableFeatures=(null) NodeAddr=198.18.0.12 NodeHostName=node2 Version=22.05.8 "
    "OS=Linux 6.18.44-fc-v1272 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=1 State=IDLE+DRAIN "
    "ThreadsPerCore=1 Partitions=main  CfgTRES=cpu=1,mem=1M,billing=1 AllocTRES= "
    "ExtSensorsTemp=n/s Reason=relay: test x [root@2026-12-07T01:48:45]")


def test_a_job_line_is_parsed_with_its_nodes_and_fence() -> None:
    job = parse_job(JOB_RUNNING)

    assert (job.job_id, job.name, job.state, job.comment) == (
        "1", "relay-x", "RUNNING", "a/b/segment-000/try-0")
    assert job.nodes == ["node1", "node3"] and not job.ended
    assert parse_job(JOB_RUNNING.replace("JobState=RUNNING", "JobState=NODE_FAIL")).ended


def test_a_node_line_keeps_a_reason_with_spaces_and_drops_slurms_stamp() -> None:
    node = parse_node(NODE_DRAINED)

    assert (node.name, node.address, node.reason) == ("node2", "198.18.0.12", "relay: test x")
    assert node.states == {"IDLE", "DRAIN"} and node.unfit and node.unresponsive is None


@pytest.mark.parametrize("state", ["DOWN+NOT_RESPONDING", "IDLE+NOT_RESPONDING", "DOWN",
                                   "ALLOCATED+FAIL", "IDLE*"])
def test_lost_nodes_are_unresponsive(state: str) -> None:
    node = parse_node(NODE_DRAINED.replace("State=IDLE+DRAIN", f"State={state}"))

    assert node.unresponsive is not None and "node2" in node.unresponsive


def test_unparseable_output_says_what_was_expected() -> None:
    with pytest.raises(SlurmError, match="expected a line with JobId= and JobState="):
        parse_job("No jobs in the system")
    with pytest.raises(SlurmError, match="expected a line with NodeName= and State="):
        parse_node("garbage")


@pytest.mark.parametrize(("text", "names"), [
    ("node[1,3]", ["node1", "node3"]), ("node[01-03],gpu7", ["node01", "node02", "node03", "gpu7"]),
    ("(null)", []), ("a,b", ["a", "b"]), ("n[1-2,5]", ["n1", "n2", "n5"])])
def test_host_lists_expand(text: str, names: list[str]) -> None:
    assert expand_hostlist(text) == names


def test_a_missing_command_and_a_silent_controller_are_clear_errors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SlurmError, match="expected Slurm's client commands on PATH.*slurm-client"):
        commands.run(["relay-no-such-sbatch"])

    def hang(*args: Any, **kwargs: Any) -> None:  # noqa: ANN401
        raise subprocess.TimeoutExpired(args[0], 1.0)

    monkeypatch.setattr(commands.subprocess, "run", hang)
    with pytest.raises(SlurmError, match="expected an answer from slurmctld.*SLURM_CONF"):
        commands.run(["true"])


def test_a_refusal_names_the_exit_code_and_slurms_message() -> None:
    with pytest.raises(SlurmError, match="expected exit 0; found 3: boom"):
        commands.run(["sh", "-c", "echo boom >&2; exit 3"])


def cfg_at(root: Path, nodes: list[str]) -> LaunchConfig:
    return LaunchConfig(job="j", seed=1, model={}, data={}, optimizer={}, start_step=0,
                        end_step=4, checkpoint_every=2, nodes=nodes, ranks_per_node=1,
                        tracking_uri="http://relay-root:5000", run_id="r",
                        attempt_dir=str(root), attempt=0, segment=0,
                        attempt_id="dag/run/segment-000/try-0", channel_secret="s3cret")


def test_the_batch_script_carries_the_launch_file_each_node_unpacks_locally(
        tmp_path: Path) -> None:
    cfg = cfg_at(tmp_path / "relay-side" / "try-0", ["node1", "node2"])
    script = batch_script(cfg, SlurmSpec(node_home=str(tmp_path / "hosts" / "{node}"),
                                         python="/opt/py"))
    exported = next(line for line in script.splitlines()
                    if line.startswith(f"export {ENV_LAUNCH_B64}="))
    encoded = exported.split("=", 1)[1].strip("'")

    launch = unpack(encoded, str(tmp_path / "hosts" / "{node}"), "node2")

    assert launch == tmp_path / "hosts" / "node2" / "dag/run/segment-000/try-0" / LAUNCH_FILE
    got = LaunchConfig.read(launch)
    assert got.root == launch.parent and got.channel_secret == "s3cret"
    assert (launch.stat().st_mode & 0o777) == 0o600
    assert ENV_LAUNCH_B64 in script and "srun --export=ALL --ntasks-per-node=1" in script
    # Slurm's SIGTERM reaches every process of the step: the ranks leave it to their agent.
    assert f"export {ENV_SHIELD_RANKS}=1" in script.splitlines()
    assert "/opt/py -m relay_train.agent.unpack" in script
    assert base64.b64decode(encoded)  # the script holds no path of Relay's disk to read


class FakeSlurm(Slurm):
    """Slurm's answers from memory; every call recorded."""

    def __init__(self, jobs: dict[str, SlurmJob], nodes: str) -> None:
        super().__init__()
        self.jobs, self.node_lines, self.calls = jobs, nodes, []  # type: ignore[var-annotated]

    def _run(self, argv: list[str], stdin: str | None = None) -> str:
        self.calls.append(argv)
        if argv[:3] == ["scontrol", "show", "node"]:
            return self.node_lines
        if argv[:3] == ["scontrol", "show", "job"]:
            job = self.jobs.get(argv[-1])
            if job is None:
                raise SlurmError("slurm_load_jobs error: Invalid job id specified")
            return JOB_RUNNING.replace("JobId=1", f"JobId={job.job_id}").replace(
                "JobState=RUNNING", f"JobState={job.state}").replace(
                "Comment=a/b/segment-000/try-0", f"Comment={job.comment}")
        if argv[0] == "scancel":
            job = self.jobs[argv[-1]]
            if argv[-2:-1] == ["KILL"] or len(argv) == 2:
                self.jobs[argv[-1]] = SlurmJob(job.job_id, job.name, "CANCELLED", "", job.comment,
                                               job.nodes, "0:9")
        return ""


def test_a_job_id_naming_another_attempt_is_never_cancelled(tmp_path: Path) -> None:
    root = tmp_path / "dag" / "run" / "segment-000" / "try-0"
    root.mkdir(parents=True)
    (root / HANDLE_FILE).write_text('{"job_id": "7", "attempt_id": "dag/run/segment-000/try-0",'
                                    ' "addresses": {}, "port": 1, "started_at": 1.0}')
    fake = FakeSlurm({"7": SlurmJob("7", "x", "RUNNING", "", "other/run/segment-000/try-3",
                                    ["node1"], "")}, NODE_DRAINED)
    launcher = SlurmLauncher(slurm=fake)

    assert launcher.stop(Attempt(root), grace_seconds=0.0) == []
    assert not [c for c in fake.calls if c[0] == "scancel"]
    assert launcher.status(Attempt(root)).nodes == {}


def test_stop_is_term_then_kill_on_the_whole_job(tmp_path: Path) -> None:
    root = tmp_path / "dag" / "run" / "segment-000" / "try-0"
    root.mkdir(parents=True)
    (root / HANDLE_FILE).write_text('{"job_id": "7", "attempt_id": "dag/run/segment-000/try-0",'
                                    ' "addresses": {}, "port": 1, "started_at": 1.0}')
    fake = FakeSlurm({"7": SlurmJob("7", "x", "RUNNING", "", "dag/run/segment-000/try-0",
                                    ["node1"], "")}, NODE_DRAINED)

    assert SlurmLauncher(slurm=fake).stop(Attempt(root), grace_seconds=0.0) == []
    assert [c for c in fake.calls if c[0] == "scancel"] == [
        ["scancel", "--full", "-s", "TERM", "7"], ["scancel", "--full", "-s", "KILL", "7"]]


def test_node_health_comes_from_slurm_unless_the_agent_already_settled() -> None:
    job = parse_job(JOB_RUNNING)
    down = parse_node(NODE_DRAINED.replace("State=IDLE+DRAIN", "State=DOWN+NOT_RESPONDING"))
    idle = parse_node(NODE_DRAINED.replace("State=IDLE+DRAIN", "State=ALLOCATED"))

    lost = node_status("node2", job, down, {"state": "running"}, 5.0)
    done = node_status("node2", job, down, {"state": "succeeded", "exit_codes": {"0": 0}}, 5.0)
    ended = node_status("node2", parse_job(JOB_RUNNING.replace("=RUNNING", "=CANCELLED")), idle,
                        {"state": "running"}, 5.0)

    assert lost.state is NodeState.UNRESPONSIVE and "DOWN+NOT_RESPONDING" in lost.detail
    assert done.state is NodeState.SUCCEEDED
    assert ended.state is NodeState.FAILED and "CANCELLED" in ended.detail
    assert node_status("node2", job, idle, None, None).state is NodeState.STARTING


def test_an_agents_preemption_notice_reaches_the_node_status() -> None:
    """Slurm's --signal (or a preemption's SIGTERM) is the agent's notice: the status carries
    it (the detector's ``preempted``), placed on Relay's clock by the answer's arrival."""
    job = parse_job(JOB_RUNNING)
    idle = parse_node(NODE_DRAINED.replace("State=IDLE+DRAIN", "State=ALLOCATED"))
    record = {"state": "running",
              PREEMPTED: {GRACE_SECONDS: 30.0, DRAIN_SECONDS: 24.0, AGE_SECONDS: 2.0}}

    noticed = node_status("node2", job, idle, record, 100.0)

    assert noticed.state is NodeState.RUNNING
    assert noticed.notice == Notice(grace_seconds=30.0, drain_by=122.0)
    assert node_status("node2", job, idle, {"state": "running"}, 100.0).notice is None


def test_quarantines_drain_with_reason_and_expiry_and_releases_resume_relays_drains() -> None:
    lines = "\n".join([
        NODE_DRAINED.replace("node2", "node1").replace("State=IDLE+DRAIN", "State=IDLE")
        .replace("Reason=relay: test x [root@2026-12-07T01:48:45]", ""),
        NODE_DRAINED,  # node2: drained by Relay earlier, quarantine now over
        NODE_DRAINED.replace("node2", "node3").replace("relay: test x", "bad fan"),  # operator's
    ])
    fake = FakeSlurm({}, lines)
    held = {"node1": Quarantine("node1", "node_unresponsive", 0.0, 4102444800.0, "t")}

    SlurmLauncher(slurm=fake).enforce_quarantines(held)

    updates = [c for c in fake.calls if c[:2] == ["scontrol", "update"]]
    assert updates == [
        ["scontrol", "update", "NodeName=node1", "State=DRAIN",
         "Reason=relay: node_unresponsive (until 2100-01-01T00:00:00Z)"],
        ["scontrol", "update", "NodeName=node2", "State=RESUME"]]


def test_the_spec_chooses_slurm_and_the_config_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("job: s\ntotal_steps: 10\nsteps_per_segment: 5\ncheckpoint_every: 5\n"
                    'launcher: slurm\nslurm:\n  node_home: "/scratch/{node}"\n'
                    "  python: /opt/py\n")

    launcher = launcher_for(load_job_spec(path))

    assert isinstance(launcher, SlurmLauncher) and launcher.continuity is None
    again = launcher_from(launcher.config())
    assert isinstance(again, SlurmLauncher) and again.settings == launcher.settings
    assert again.settings.node_home == "/scratch/{node}"
    assert job_name(Path("/x/dag/run/segment-001")) == job_name(Path("/y/dag/run/segment-001"))
    assert os.path.basename(str(launcher.settings.python)) == "py"




def test_rank_0s_first_step_comes_back_over_the_channel_into_relays_folder(
        tmp_path: Path) -> None:
    relay_root = tmp_path / "relay"
    relay_root.mkdir()
    record = {"state": "running", FIRST_STEP: {"step": 0, "at": 12.5, "spawned_at": 10.0}}
    channel = AgentChannel("attempt", {}, "secret")
    channel.reports["node1"] = NodeReport("node1", 1.0, record, {}, set())

    channel.keep_node_records(relay_root)

    assert json.loads((relay_root / FIRST_STEP_FILE).read_text())["at"] == 12.5


def test_cancelling_a_job_slurm_already_ended_or_forgot_is_no_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    said = iter(["scancel: error: Kill job error on job id 2: Invalid job id specified",
                 "scancel: error: Kill job error on job id 2: Job/step already completing or "
                 "completed", "scancel: error: Unable to contact slurm controller"])

    def refuse(argv: list[str], *args: Any) -> str:  # noqa: ANN401
        raise SlurmError(f"scancel: expected exit 0; found 1: {next(said)}")

    monkeypatch.setattr(commands, "run", refuse)
    Slurm().cancel("2", "TERM")
    Slurm().cancel("2")
    with pytest.raises(SlurmError, match="Unable to contact"):
        Slurm().cancel("2")


def test_a_node_slurm_has_drained_or_lost_is_refused_at_launch_not_waited_for(
        tmp_path: Path) -> None:
    fake = FakeSlurm({}, NODE_DRAINED.replace("relay: test x", "bad fan"))  # node2, by an operator

    with pytest.raises(SlurmError, match=r"nodes \['node2'\]: expected them up and not drained.*"
                                         r"DRAIN\+IDLE \(bad fan\)"):
        SlurmLauncher(slurm=fake).launch(cfg_at(tmp_path / "try-0", ["node2"]))
    assert not [c for c in fake.calls if c[0] == "sbatch"]


class StopAnswered:
    """The channel of an attempt whose agents all answer a stop (``answer``: who says yes)."""

    def __init__(self, addresses: list[str], answer: list[str]) -> None:
        self.addresses = {n: f"http://{n}:1" for n in addresses}
        self.answer = set(answer)

    def ask_to_stop(self) -> set[str]:
        return self.answer


class EndsWhenAsked(FakeSlurm):
    """A job that ends by itself once every agent was asked (they stop, send logs, exit)."""

    def __init__(self, jobs: dict[str, SlurmJob], nodes: str, channel: StopAnswered) -> None:
        super().__init__(jobs, nodes)
        self.channel = channel

    def _run(self, argv: list[str], stdin: str | None = None) -> str:
        if argv[:3] == ["scontrol", "show", "job"] and self.channel.answer == set(
                self.channel.addresses):
            job = self.jobs[argv[-1]]
            self.jobs[argv[-1]] = SlurmJob(job.job_id, job.name, "COMPLETED", "", job.comment,
                                           job.nodes, "0:0")
        return super()._run(argv, stdin)


@pytest.mark.parametrize(("answer", "signalled"), [(["node1", "node2"], False),
                                                   (["node1"], True)])
def test_agents_that_all_said_yes_to_a_stop_end_their_job_before_any_signal(
        tmp_path: Path, answer: list[str], signalled: bool) -> None:
    """An agent stops its ranks and sends their logs to MLflow before it exits: Slurm's
    signals would end it first. A node that did not answer (frozen) gets them at once."""
    root = tmp_path / "dag" / "run" / "segment-000" / "try-0"
    root.mkdir(parents=True)
    (root / HANDLE_FILE).write_text('{"job_id": "7", "attempt_id": "dag/run/segment-000/try-0",'
                                    ' "addresses": {}, "port": 1, "started_at": 1.0}')
    channel = StopAnswered(["node1", "node2"], answer)
    fake = EndsWhenAsked({"7": SlurmJob("7", "x", "RUNNING", "", "dag/run/segment-000/try-0",
                                        ["node1", "node2"], "")}, NODE_DRAINED, channel)
    launcher = SlurmLauncher(slurm=fake)
    launcher._channels[root] = channel  # type: ignore[assignment]

    assert launcher.stop(Attempt(root), grace_seconds=0.0) == []
    scancels = [c for c in fake.calls if c[0] == "scancel"]
    assert bool(scancels) is signalled, scancels
