"""The fix a job spec's problem suggests, per field (and for an empty file): concrete
text, with an example, that :mod:`relay.spec.job` puts under each problem it reports.
"""

from __future__ import annotations

FIXES: dict[str, str] = {
    "job": (
        "set job to a lowercase name of letters, digits, '-' or '_' that starts with a "
        "letter or digit, at most 63 characters, e.g. job: demo"
    ),
    "description": 'set description to text in quotes, e.g. description: "Nightly char model"',
    "seed": "set seed to a whole number >= 0, e.g. seed: 1234",
    "total_steps": "set total_steps to a whole number of steps > 0, e.g. total_steps: 240, "
    "or give epochs and steps_per_epoch instead (e.g. epochs: 4 / steps_per_epoch: 60)",
    "epochs": "set epochs to a whole number of passes over the data > 0, with "
    "steps_per_epoch, e.g. epochs: 4",
    "steps_per_epoch": "set steps_per_epoch to the number of batches in one epoch of the "
    "script's DataLoader on each rank (len(loader)), a whole number > 0, e.g. "
    "steps_per_epoch: 60",
    "steps_per_segment": (
        "set steps_per_segment to a whole number of steps > 0, e.g. steps_per_segment: 60"
    ),
    "checkpoint_every": (
        "set checkpoint_every to a whole number of steps > 0 and no more than "
        "steps_per_segment (e.g. checkpoint_every: 20), or to auto (Relay picks it from the "
        "job's checkpoint cost and fault history; e.g. checkpoint_every: {auto: true, min: 10, "
        "max: 60})"
    ),
    "checkpoint_every.auto": "write auto: true, or give checkpoint_every a number of steps",
    "checkpoint_every.min": (
        "set checkpoint_every.min to the fewest steps between checkpoints, a whole number "
        ">= 1, e.g. min: 10"
    ),
    "checkpoint_every.max": (
        "set checkpoint_every.max to the most steps between checkpoints, a whole number "
        "from min to steps_per_segment, e.g. max: 60"
    ),
    "nodes": "set nodes to a whole number of simulated nodes >= 1, e.g. nodes: 2",
    "ranks_per_node": "set ranks_per_node to a whole number >= 1, e.g. ranks_per_node: 2",
    "model": "write model as a mapping, e.g. model: {d_model: 64, n_heads: 4}",
    "model.context": "set model.context to a whole number of characters >= 2, e.g. context: 64",
    "model.d_model": "set model.d_model to a multiple of model.n_heads, e.g. d_model: 64",
    "model.n_layers": "set model.n_layers to a whole number >= 1, e.g. n_layers: 2",
    "model.n_heads": "set model.n_heads to a whole number >= 1 dividing d_model, e.g. n_heads: 4",
    "model.dropout": "set model.dropout to a number from 0 up to (not including) 1, e.g. 0.1",
    "data": "write data as a mapping, e.g. data: {corpus: builtin:python_docs, batch_size: 16}",
    "data.corpus": (
        "set data.corpus to builtin:<name> (e.g. builtin:python_docs) or a path to a text file"
    ),
    "data.batch_size": "set data.batch_size to a whole number >= 1, e.g. batch_size: 16",
    "optimizer": "write optimizer as a mapping, e.g. optimizer: {lr: 0.003, weight_decay: 0.01}",
    "optimizer.lr": "set optimizer.lr to a number > 0, e.g. lr: 0.003",
    "optimizer.weight_decay": "set optimizer.weight_decay to a number >= 0, e.g. 0.01",
    "policy": (
        "set policy to the name of a file in the policies folder (e.g. policy: default) "
        "or to a path ending in .yaml relative to this spec's folder"
    ),
    "retries": "set retries to a whole number >= 0, e.g. retries: 2",
    "retry_delay": "set retry_delay to a duration such as 2s, 500ms or 1m, e.g. retry_delay: 2s",
    "collective_timeout": (
        "set collective_timeout to a duration > 0 such as 30m or 1h, e.g. collective_timeout: 30m"
    ),
    "entrypoint": (
        "write entrypoint as a mapping with module or script, e.g. entrypoint: "
        "{module: mypkg.train, args: [--lr, '3e-4']} or entrypoint: {script: train.py}"
    ),
    "entrypoint.module": "set entrypoint.module to a dotted module name, e.g. mypkg.train",
    "entrypoint.script": "set entrypoint.script to a Python file, relative to this spec's folder",
    "entrypoint.args": "write entrypoint.args as a list of strings, e.g. args: [--lr, '3e-4']",
    "entrypoint.workdir": "set entrypoint.workdir to the ranks' working directory, relative "
    "to this spec's folder or absolute, e.g. workdir: .",
    "entrypoint.python": "set entrypoint.python to the ranks' interpreter or a venv folder, "
    "relative to this spec's folder or absolute, e.g. python: /opt/venvs/train (relay spec "
    "venv DIR makes one layered on Relay's environment), or remove it to use Relay's own",
    "entrypoint.env": "write entrypoint.env as a mapping of variable names to quoted text, "
    'e.g. env: {HF_HOME: /data/hf, TOKENIZERS_PARALLELISM: "false"}',
    "heartbeat_interval": (
        "set heartbeat_interval to a duration > 0 such as 0.5s or 500ms, "
        "e.g. heartbeat_interval: 0.5s"
    ),
    "backend": (
        "set backend to auto (NCCL when every rank of a node gets a GPU, else gloo), "
        "gloo or nccl, e.g. backend: auto"
    ),
    "deterministic": (
        "set deterministic to true (bit-exact resume; deterministic GPU kernels) or false"
    ),
    "chaos": (
        "set chaos: allowed to let DAG runs inject faults (test and demo jobs only), or remove "
        "the line (the default, forbidden)"
    ),
    "segment_boundary": "set segment_boundary to adopt (the next segment takes over the "
    "running workload at the boundary checkpoint) or restart (a fresh launch per segment)",
    "launcher": "set launcher to local (processes on this machine), kubernetes (a Job per "
    "segment attempt) or slurm (a Slurm job per segment attempt), e.g. launcher: local",
    "slurm": "write slurm as a mapping, e.g. slurm: {node_home: '/var/tmp/relay/{node}', "
    "python: /opt/relay/bin/python} (see docs/slurm.md)",
    "kubernetes": "write kubernetes as a mapping, e.g. kubernetes: {image: "
    "registry.example.com/relay-worker:0.1.0, namespace: relay}",
    "kubernetes.image": "set kubernetes.image to the worker image the pods run, e.g. "
    "image: registry.example.com/relay-worker:0.1.0 (built from deploy/worker.Dockerfile)",
    "kubernetes.namespace": "set kubernetes.namespace to a namespace name (lowercase letters, "
    "digits, '-'), e.g. namespace: relay",
    "kubernetes.service_account": "set kubernetes.service_account to the pods' service account "
    "(lowercase letters, digits, '-'), e.g. service_account: relay-worker",
    "kubernetes.gpus_per_pod": "set kubernetes.gpus_per_pod to a whole number >= 0 (0: CPU "
    "only), e.g. gpus_per_pod: 8",
    "kubernetes.active_deadline": "set kubernetes.active_deadline to a duration > 0 that one "
    "segment attempt may not outlive, e.g. active_deadline: 6h",
    "kubernetes.taint_quarantine": "set kubernetes.taint_quarantine to true (quarantined nodes "
    "also get a NoSchedule taint; needs RBAC to patch nodes) or false",
    "kubernetes.cpu": "set kubernetes.cpu to each pod's CPUs as a Kubernetes quantity "
    "(requested and limited), e.g. cpu: 8 or cpu: 500m",
    "kubernetes.memory": "set kubernetes.memory to each pod's memory as a Kubernetes quantity "
    "(requested and limited), e.g. memory: 64Gi",
    "kubernetes.airflow_namespace": "set kubernetes.airflow_namespace to the namespace of "
    "Airflow's workers and triggerer (the only pods let in to the agents' port), e.g. "
    "airflow_namespace: airflow",
}

EMPTY_FIX = (
    "add at least job, total_steps, steps_per_segment and checkpoint_every, e.g. "
    "job: demo / total_steps: 240 / steps_per_segment: 60 / checkpoint_every: 20 "
    "(one per line)"
)
