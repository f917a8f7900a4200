"""The contracts both sides share: standard library only.

Relay (``relay``) and the worker side (``relay_train``) both import these, and
Relay imports nothing else of ``relay_train`` but for its local launcher, MLflow
publishing and benchmarks. Nothing here imports torch, MLflow or Airflow.

- ``heartbeat``: a rank's heartbeat record, its writer and reader, a node's clock;
- ``launch``: the launch file (everything an agent and its ranks need) and the
  node-local files of an attempt;
- ``manifest``: checkpoint manifests and their artifact layout;
- ``pids``: process identity (a PID with its start time), and safe signals;
- ``routes``: the channel between Relay and a node's agent: routes, the fields
  of requests and answers, ``NodeState``;
- ``env``: the environment variables one side sets and the other reads;
- ``injection``: an injected fault (``InjectedFault``), as a run conf gives it;
- ``rescue_files``, ``stacks_files``: the node-local files of a rescue and of a
  request for stacks, and the answers Relay reads.
"""
