"""The MLflow tags Relay writes: one vocabulary, importable without MLflow.

A DAG run is a parent run; each segment attempt a child run (``mlflow.parentRunId``).
"""

TAG_JOB = "relay.job"
TAG_DAG_ID = "relay.dag_id"
TAG_DAG_RUN = "relay.dag_run_id"
TAG_SEGMENT = "relay.segment"
TAG_TRY = "relay.try_number"
TAG_OUTCOME = "relay.outcome"
TAG_PARENT = "mlflow.parentRunId"
TAG_FAULT = "relay.fault_kind"
TAG_FAILURE_REASON = "relay.failure_reason"  # why a run ended FAILED without a fault
# The experiment's kind (model training); MLflow 3.17's UI reads the URL instead (see below).
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
TAG_REJECTED = "relay.rejected."  # + step dir name, on the run that logged the checkpoint
# Fencing: set on an attempt's run when Relay stops or replaces it. Only the checkpoints
# published by then count; one its nodes publish later (a partitioned node coming back)
# is refused by the resume chooser, and the refusal recorded as a rejected tag.
TAG_FENCED_AT = "relay.fenced_at"  # epoch seconds on Relay's clock
TAG_FENCED_CHECKPOINTS = "relay.fenced_checkpoints"  # the step dirs accepted, comma-separated
TAG_FENCED_REASON = "relay.fenced_reason"
# An attempt run that ended in a fault: what, who, and what the policy decided.
TAG_DECISION = "relay.decision"
TAG_RULE = "relay.rule"
TAG_POLICY_SHA256 = "relay.policy_sha256"
TAG_CULPRIT_NODE = "relay.culprit_node"
TAG_CULPRIT_RANK = "relay.culprit_rank"
TAG_LOST_STEPS = "relay.lost_steps"
TAG_MODE = "relay.mode"  # "observe": the decision was recorded, not applied
TAG_OBSERVED = "relay.observed"  # observe-mode decisions an attempt made while it ran on
# An attempt that handed its workload over at its end, or adopted one.
TAG_HANDED_OVER_AT = "relay.handed_over_at_step"
TAG_ADOPTED_AT = "relay.adopted_at_step"
# A DAG run's parent run: its final checkpoint, or why and where it failed.
TAG_FINAL_CHECKPOINT = "relay.final_checkpoint"
TAG_FINAL_SHA256 = "relay.final_sha256"
TAG_FAILED_TASK = "relay.failed_task"
# A checkpoint's MLflow logged model (relay/lineage/models.py).
TAG_MODEL_CHECKPOINT = "relay.checkpoint"  # <attempt run id>/step-NNNNNNNN: one model each
TAG_MODEL_CHECKPOINT_URI = "relay.checkpoint_uri"  # its artifacts: the model holds no copy
TAG_MODEL_SHA256 = "relay.sha256"
TAG_MODEL_KEY_ID = "relay.signature_key_id"
TAG_MODEL_PARENT = "relay.parent_model_id"  # the parent checkpoint's model; "" at the first
TAG_MODEL_PROBLEM = "relay.check_failed"  # why a FAILED model's checkpoint does not hold
# A DAG run's parent run: its faults, "hang:1,crash:2" by kind, or "none".
TAG_FAULTS = "relay.faults"
# MLflow 3.17's UI picks an experiment's view from the URL's workflowType (else the
# browser's last choice, GenAI by default), not from mlflow.experimentKind: Relay's links
# to MLflow carry it.
UI_WORKFLOW_PARAM = "workflowType"
UI_MODEL_TRAINING = "machine_learning"
