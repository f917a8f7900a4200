"""The environment variables one side sets and the other reads, named once.

A launcher (Relay's side) or a node agent sets them for the node's processes; the
agent, its ranks and the user's script read them. A variable only one side knows
about stays with its reader (Relay's test hooks in ``relay.core``, torch's own
``TORCH_FR_BUFFER_SIZE`` in :mod:`relay_train.stacks`). Stdlib only: it names, it
reads nothing.
"""

from __future__ import annotations

# Set for every rank by its node agent (relay_train.agent.node; under torchrun by
# relay_train.baselines.torchrun_worker).
ENV_LAUNCH = "RELAY_LAUNCH"  # the launch file, for relay_train.init() in a rank
ENV_NODE = "RELAY_NODE"  # the node the rank runs on
ENV_HEARTBEAT_DIR = "RELAY_HEARTBEAT_DIR"
ENV_HEARTBEAT_INTERVAL = "RELAY_HEARTBEAT_INTERVAL_SECONDS"
ENV_SPAWNED_AT = "RELAY_SPAWNED_AT"  # time.time() when the agent started the rank
# Set where a node's ranks are not one process group (torchrun gives each a session):
# the pid of the process that stands for the node's agent, which a chaos stop_node freezes.
ENV_NODE_AGENT_PID = "RELAY_NODE_AGENT_PID"

# The segment a rank trains, for the user's script (LaunchConfig.rank_environment).
ENV_START_STEP = "RELAY_START_STEP"
ENV_END_STEP = "RELAY_END_STEP"
ENV_TOTAL_STEPS = "RELAY_TOTAL_STEPS"  # the job's last step (its total_steps)
ENV_ATTEMPT_DIR = "RELAY_ATTEMPT_DIR"
ENV_SEGMENT = "RELAY_SEGMENT"
ENV_ATTEMPT = "RELAY_ATTEMPT"
ENV_RESUME_PATH = "RELAY_RESUME_PATH"
# Read by a script run outside Relay (relay_train.local): its local checkpoint folder;
# ENV_TOTAL_STEPS above gives its length there.
ENV_LOCAL_CHECKPOINT_DIR = "RELAY_CHECKPOINT_DIR"

# Set by the Kubernetes launcher in each pod: the pod's completion index (the agent's
# ``--node-index``) and the machine it landed on.
ENV_NODE_INDEX = "RELAY_NODE_INDEX"
ENV_HOST = "RELAY_HOST"
# The MLflow tracking URI, when a launch file leaves it out (a Kubernetes pod's launch file
# travels in a ConfigMap; the URI, which may carry credentials, in a Secret as this
# variable). The same variable names Relay's own URI (relay.core.settings).
ENV_TRACKING_URI = "RELAY_MLFLOW_TRACKING_URI"
# Set by the Kubernetes launcher in each pod when the channel is TLS: the agent's certificate
# and private key (PEM, from the channel's TLS Secret); see relay_train.protocol.channel_tls.
# Neither set: the agent serves clear text (local launches).
ENV_CHANNEL_TLS_CERT = "RELAY_CHANNEL_TLS_CERT"
ENV_CHANNEL_TLS_KEY = "RELAY_CHANNEL_TLS_KEY"

# The checkpoint key ring file (relay_train.protocol.signing), where the launch file does
# not carry the ring: a Kubernetes Secret mounted into the pods, or a file an operator
# gives Relay's processes (read by both sides).
ENV_CHECKPOINT_KEYS_FILE = "RELAY_CHECKPOINT_KEYS_FILE"

# Test hook only: shift a node's clock (heartbeats, its agent) by this many seconds, to
# prove that Relay judges heartbeat ages on its own clock. A number applies to every node;
# "node-b=30,node-c=-30" to the named nodes only (the node agent resolves it for its ranks).
ENV_CLOCK_SKEW = "RELAY_CLOCK_SKEW_SECONDS"

# The attempt's channel secret (relay_train.protocol.channel_auth), for a node agent whose
# platform hands it over outside the launch file (a per-attempt Kubernetes Secret). When
# set, it wins over the launch file's ``channel_secret``; the agent removes it from its
# environment once read, so that neither its ranks nor a standby it forks inherit it.
ENV_CHANNEL_SECRET = "RELAY_CHANNEL_SECRET"
# The launch file itself (base64 of its JSON), where the node cannot read Relay's disk: a Slurm
# batch script exports it and relay_train.agent.unpack writes it into a node-local folder.
ENV_LAUNCH_B64 = "RELAY_LAUNCH_B64"

# Set by a launcher whose platform gives a node notice before taking it back (a Kubernetes
# pod's terminationGracePeriodSeconds, Slurm's --signal=TERM@N, a spot reclaim's warning):
# the seconds from the SIGTERM its node agent receives to the platform's SIGKILL. Unset: the
# agent assumes relay_train.protocol.routes.DEFAULT_PREEMPT_GRACE_SECONDS.
ENV_PREEMPT_GRACE = "RELAY_PREEMPT_GRACE_SECONDS"
# Set ("1") by a launcher whose platform signals every process of a node, ranks included
# (Slurm: `scancel --signal`, `--signal=TERM@N` and a preemption's SIGTERM reach the whole
# job step): the ranks ignore SIGTERM, so the agent alone takes it as the notice, and the
# agent ends its ranks with SIGUSR1 instead (relay_train.agent.ranks.end_signal).
ENV_SHIELD_RANKS = "RELAY_SHIELD_RANKS"


# What the rank's environment gets from torchrun's contract and Relay: a job spec's
# ``entrypoint.env`` may not set these (names, or a prefix ending in ``_``).
RESERVED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_", "RELAY_")
