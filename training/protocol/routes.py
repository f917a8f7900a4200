"""The channel between Relay and a node's agent: its routes, messages and node states.

The agent serves them (:mod:`relay_train.agent.server`), Relay asks them
(:mod:`relay.launchers.agent_client` and the recovery steps that use it); both
spell every path, field and state from here. Requests and answers are JSON
objects (``rescue/file`` answers the file's bytes). Every request names its
attempt (:data:`ATTEMPT`, in the query or the body) and every JSON answer carries
the agent's own attempt and node (fencing: see the server's docstring). An
answer the agent refuses carries :data:`ERROR`. Stdlib only.
"""

from __future__ import annotations

from enum import StrEnum

API_PREFIX = "/v1"
AGENT_PORT = 29401  # on Kubernetes: every pod's agent listens here (locally: a free port)
MAX_BODY_BYTES = 64 * 1024  # a larger request body is refused (413) unread


class Route(StrEnum):
    """A route of the agent's API, relative to :data:`API_PREFIX` (see :func:`route_path`)."""

    STATUS = "status"  # GET: the agent's state, its ranks' heartbeats and exit codes
    STOP = "stop"  # POST: stop the ranks and end
    DRAIN = "drain"  # POST: stop every rank at a step, after a checkpoint
    RESCUE = "rescue"  # POST: ask a rank for its in-memory state; GET: how that goes
    RESCUE_FILE = "rescue/file"  # GET: the rescued state's bytes
    STACKS = "stacks"  # POST: ask every rank for its stacks; GET: their answers
    STACKS_SIGNAL = "stacks/signal"  # POST: have silent ranks dump their stacks from C
    CLAIM = "claim"  # POST: who acts on this attempt's fault (the first claimer wins)
    STANDBY = "standby"  # POST: fork a preloaded standby agent for the next attempt
    SUMMARY = "summary"  # GET (an aggregator's only): its group's agents' status in one answer


def route_path(route: Route) -> str:
    """Return the URL path of ``route`` (``/v1/status``)."""
    return f"{API_PREFIX}/{route}"


class NodeState(StrEnum):
    """What a node is doing, as its agent reports it (or the launcher sees it).

    An agent says ``starting`` while it preloads, ``running`` once its ranks are
    forked, then ``succeeded`` (every rank exited 0) or ``failed``. Only a launcher
    says ``unresponsive``: the platform reports the node stopped answering (a NotReady
    Kubernetes node, a pod stuck terminating), which the detector turns into a
    ``node_unresponsive`` fault at once.
    """

    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNRESPONSIVE = "unresponsive"


SETTLED = frozenset({NodeState.SUCCEEDED, NodeState.FAILED})  # a node's ranks have all ended

# -- fields of every message -----------------------------------------------------------
ATTEMPT = "attempt"  # the attempt a request is for; the one the answering agent serves
NODE = "node"  # the answering agent's node
ERROR = "error"  # why a request was refused (4xx, 5xx)

# -- GET status: the answer ------------------------------------------------------------
STATE = "state"  # a NodeState
AGENT_PID = "agent_pid"
PGID = "pgid"
RANK_PIDS = "rank_pids"  # rank (as a string) -> pid
EXIT_CODES = "exit_codes"  # rank (as a string) -> exit code, null while it runs
ERRORS = "errors"  # failed rank (as a string) -> the end of its log
AGENT_CLOCK = "agent_clock"  # the agent's wall clock when it answered
HEARTBEATS = "heartbeats"  # the node's ranks' heartbeat records, each with its two ages:
AGE_SECONDS = "age_seconds"  # since the record was written, on the node's clock
PHASE_AGE_SECONDS = "phase_age_seconds"  # since the rank entered its phase, likewise
FIRST_STEP = "first_step"  # rank 0's first productive step (launch.FIRST_STEP_FILE's record)
CHAOS = "chaos"  # the faults injected on the node so far (its chaos.jsonl's records), if any
CROSSED = "crossed"  # the last segment boundaries rank 0 recorded crossing (rank 0's node)
# Only from an agent that received a preemption notice (SIGTERM that was not Relay's stop):
# {grace_seconds, drain_seconds, age_seconds}: the platform's grace, how long after the notice
# the ranks may train (the agent stops them then, to end before the platform's SIGKILL), and
# the notice's age on the node's clock.
PREEMPTED = "preempted"
GRACE_SECONDS = "grace_seconds"
DRAIN_SECONDS = "drain_seconds"
DEFAULT_PREEMPT_GRACE_SECONDS = 30.0  # Kubernetes' default terminationGracePeriodSeconds

# -- GET summary: the answer of an aggregator (relay.launchers.aggregator) ---------------
NODES = "nodes"  # node -> its agent's latest status (STATE, EXIT_CODES, ERRORS, CROSSED) and:
SEEN_AGE_SECONDS = "seen_age_seconds"  # since the aggregator last heard that agent, on its clock
BEATS = "beats"  # the node's heartbeats, each a list of BEAT_FIELDS' values in that order
BEAT_FIELDS = ("rank", "pid", "pid_started", "step", "phase", "compute_seconds", "compute_total",
               "samples_per_second", "step_seconds", "cpu_wait_seconds", "cpu_wait_total",
               "phase_cpu_wait", "loss", "nonfinite_step", "seq", AGE_SECONDS, PHASE_AGE_SECONDS)

# -- POST stop -------------------------------------------------------------------------
REASON = "reason"  # request: why (for the agent's log)
STOPPING = "stopping"  # answer: true

# -- POST drain: request and answer (and the node-local drain file) --------------------
STOP_AT = "stop_at"  # the step every rank stops at

# -- POST rescue: request (rank, fault) and answer (rank) ------------------------------
RANK = "rank"  # the rank asked to hand over its state
FAULT = "fault"  # the fault kind that made Relay ask (for the ranks' logs)
# -- GET rescue: the answer ------------------------------------------------------------
ACK = "ack"  # the rank is on it
DONE = "done"  # the rank's RescueResult (relay_train.protocol.rescue_files), once written
# -- GET rescue/file: the query --------------------------------------------------------
STEP = "step"  # the rescued step whose file is wanted

# -- POST stacks: request (id, fault, culprit_rank) and answer (id) --------------------
REQUEST_ID = "id"  # names one request for stacks; answers name it back
CULPRIT_RANK = "culprit_rank"
# -- GET stacks (query: id): the answer, each keyed by rank (as a string) --------------
ANSWERS = "answers"  # the stacks records of the ranks that answered this id
TRACES = "traces"  # their Flight Recorder traces (JSON)
FR_PICKLES = "fr"  # their Flight Recorder dumps as torch's pickle, base64
FAULTHANDLER = "faulthandler"  # the C-level stacks of ranks that did not answer
EXITED = "exited"  # ranks that exited: a list, they can answer nothing
# -- POST stacks/signal (id): the answer -----------------------------------------------
SIGNALLED = "signalled"  # ranks whose faulthandler was signalled

# -- POST claim ------------------------------------------------------------------------
BY = "by"  # request: who claims
GRANTED = "granted"  # answer: whether this claimer holds the claim
HOLDER = "holder"  # answer: who holds it

# -- POST standby ----------------------------------------------------------------------
DIRECTORY = "directory"  # request: the standby folder (absolute)
TTL = "ttl"  # request: seconds the standby waits to be taken before it leaves
STANDBY_TTL_SECONDS = 60.0  # the ttl Relay asks for (plus a retry's backoff, if any)
MAX_STANDBY_TTL_SECONDS = 6 * 3600.0  # an agent refuses a longer ttl (400)
LINGER = "linger"  # request: seconds its agent answers after its ranks end
MAX_LINGER_SECONDS = 3600.0  # an agent refuses a longer linger (400)
PID = "pid"  # answer: the standby's pid
