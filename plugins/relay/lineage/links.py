"""Links into MLflow's UI that open on its model-training view (importable without MLflow).

MLflow 3.17's UI chooses an experiment's view (GenAI: Traces, "Evaluations"; or model
training: Runs, Models) from the URL's ``workflowType``, else from the browser's last
choice, GenAI in a fresh browser; the experiment's ``mlflow.experimentKind`` tag does not
change it. Every link Relay prints or shows carries ``workflowType=machine_learning``.
"""

from __future__ import annotations

from urllib.parse import urlencode

from relay.lineage.tags import UI_MODEL_TRAINING, UI_WORKFLOW_PARAM

QUERY = urlencode({UI_WORKFLOW_PARAM: UI_MODEL_TRAINING})


def _page(ui: str, path: str) -> str:
    return f"{ui.rstrip('/')}/#/{path}?{QUERY}"


def experiments_url(ui: str) -> str:
    """Return the experiment list of the MLflow UI at ``ui``, in its model-training view."""
    return _page(ui, "experiments")


def experiment_url(ui: str, experiment_id: str, tab: str = "") -> str:
    """Return one experiment (MLflow picks its first tab) or one of its tabs (``runs``,
    ``models``), in the model-training view."""
    return _page(ui, f"experiments/{experiment_id}" + (f"/{tab}" if tab else ""))


def run_url(ui: str, experiment_id: str, run_id: str) -> str:
    """Return one run's page."""
    return _page(ui, f"experiments/{experiment_id}/runs/{run_id}")


def model_url(ui: str, experiment_id: str, model_id: str) -> str:
    """Return one logged model's page (a checkpoint, relay/lineage/models.py)."""
    return _page(ui, f"experiments/{experiment_id}/models/{model_id}")


def ui_of(tracking_uri: str) -> str | None:
    """Return the UI of a tracking server (the same address); None for a direct store."""
    return tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) else None
