# The image Relay's pods run: a node agent (`python -m relay_train.agent.node`) and its ranks.
# Only the worker side: torch, MLflow's client (rank 0 publishes checkpoints), tenacity;
# never Airflow. Not built in CI: these machines have no Docker engine.
#
#   docker build -f deploy/worker.Dockerfile -t REGISTRY/relay-worker:0.1.0 .
#
# For NVIDIA GPUs, install torch 2.13.0's CUDA build instead of the CPU one:
#   --build-arg TORCH_INDEX_URL=<your PyTorch CUDA wheel index>
FROM python:3.11-slim

ARG TORCH_INDEX_URL=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=1 \
    PYTHONPATH=/opt/relay

WORKDIR /opt/relay
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0 \
 && pip install --no-cache-dir mlflow==3.17.2 tenacity==9.2.1
# The worker package is imported as `relay_train` (pyproject's package-dir maps it to
# training/): copy it under that name, so `python -m relay_train.agent.node` finds it.
COPY training ./relay_train

# A numeric non-root user: the pods set runAsNonRoot, which the kubelet checks by UID.
RUN useradd --uid 50000 --no-create-home --shell /usr/sbin/nologin relay
USER 50000
ENTRYPOINT []
CMD ["python", "-m", "relay_train.agent.node", "--help"]
