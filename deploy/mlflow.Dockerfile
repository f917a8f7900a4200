# MLflow tracking server image for deploy/mlflow.yaml (PostgreSQL backend, S3 artifacts).
#   docker build -f deploy/mlflow.Dockerfile -t REGISTRY/relay-mlflow:3.17.2 deploy
FROM python:3.11-slim
RUN pip install --no-cache-dir mlflow==3.17.2 psycopg2-binary==2.9.13 boto3==1.44.8 \
 && useradd --uid 50000 --no-create-home --shell /usr/sbin/nologin mlflow
USER 50000
