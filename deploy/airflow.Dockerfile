# The Airflow image for the official Helm chart: Relay's plugin, DAGs, specs and
# policies on top of the official Airflow 3.3.2 image. Not built in CI (no Docker engine).
#
#   docker build -f deploy/airflow.Dockerfile -t REGISTRY/relay-airflow:0.1.0 .
FROM apache/airflow:3.3.2-python3.11

USER airflow
COPY --chown=airflow:root requirements.lock pyproject.toml README.md /opt/relay/
# torch first and pinned (CPU build is enough here: Airflow only verifies checkpoints).
RUN pip install --no-cache-dir torch==2.13.0 \
 && pip install --no-cache-dir -r /opt/relay/requirements.lock
COPY --chown=airflow:root plugins /opt/relay/plugins
COPY --chown=airflow:root training /opt/relay/training
COPY --chown=airflow:root dags /opt/relay/dags
COPY --chown=airflow:root policies /opt/relay/policies
RUN pip install --no-cache-dir --no-deps --no-build-isolation /opt/relay
ENV RELAY_JOBS_DIR=/opt/relay/dags/jobs \
    RELAY_POLICIES_DIR=/opt/relay/policies
