"""An Airflow DAG that enriches a partitioned table every night with `batchinfer nightly`.

Copy this file and examples/summarise.jinja into your DAGs folder (nothing in batchinfer imports
it). Each run processes every partition of INPUT that OUTPUT's manifests do not cover yet, so the
DAG needs no catch-up of its own (``catchup=False``): a night that failed is made up by the next.
Retries are safe, and so are two runs at once: the jobs' ids come from the partitions, so a retry
joins the jobs the failed try left running instead of submitting them again (docs/datasets.md,
"Nightly runs"). ``batchinfer nightly`` exits 0 when every partition is written; 5 (a job
failed), 6 (``--timeout`` passed: the jobs go on) and 7 (the input cannot be read) fail the task,
which Airflow retries.

The queue's daemons (scheduler, workers serving MODEL, exporter) run elsewhere. The task needs
their ``BATCHINFER_REDIS_URL`` and ``BATCHINFER_OUTPUT_URI_PREFIXES``, the exporter's
``BATCHINFER_FILES_DIR`` (the kept columns travel through it) and S3 access: keep secrets (the Redis
URL's password, AWS keys) in the worker's environment or your secrets backend, not here.

Two ways to run the command: a BashOperator on an Airflow worker with batchinfer installed
(``pip install batchinfer``), or, with ``USE_KUBERNETES = True``, a KubernetesPodOperator running
the batchinfer image (its entrypoint is ``batchinfer``) with the template from a ConfigMap
(``kubectl create configmap batchinfer-templates --from-file=examples/summarise.jinja``).
"""

from __future__ import annotations

import datetime as dt
import shlex
from pathlib import Path

from airflow import DAG

INPUT = "s3://lake/events/"
OUTPUT = "s3://lake/enriched/"  # under BATCHINFER_OUTPUT_URI_PREFIXES of the queue's daemons
MODEL = "Llama-3.1-8B-Instruct"  # a name the queue's workers serve
TIMEOUT_S = 6 * 3600  # stop waiting after 6 h (exit 6), before Airflow's own execution_timeout
USE_KUBERNETES = False
ENV = {  # not secret; append_env keeps the worker's own environment (secrets) beside these
    "AWS_REGION": "eu-west-1",  # or AWS_ENDPOINT_URL for MinIO, Ceph, R2
    "BATCHINFER_FILES_DIR": "s3://lake/batchinfer-files",  # the exporter's, shared
    "BATCHINFER_OUTPUT_URI_PREFIXES": OUTPUT,
}


def nightly_args(template: str) -> list[str]:
    """The command line, without the leading ``batchinfer``."""
    return ["nightly", "--input", INPUT, "--output", OUTPUT, "--model", MODEL, "--template", template,
            "--keep-columns", "id,lang", "--partition-by", "date", "--timeout", str(TIMEOUT_S), "--json"]


with DAG(
    dag_id="batchinfer_nightly",
    schedule="30 1 * * *",  # 01:30 UTC, once the upstream job has written yesterday's partition
    start_date=dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc),
    catchup=False,  # every run catches up by itself: it processes all partitions not yet written
    default_args={"retries": 3, "retry_delay": dt.timedelta(minutes=15)},
    tags=["batchinfer"],
):
    if USE_KUBERNETES:
        from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
        from kubernetes.client import models as k8s

        KubernetesPodOperator(
            task_id="enrich_events",
            name="batchinfer-nightly",
            image="batchinfer:latest",
            arguments=nightly_args("/templates/summarise.jinja"),
            env_vars=ENV,  # plus secrets: env_from=[k8s.V1EnvFromSource(secret_ref=...)]
            volumes=[k8s.V1Volume(name="templates", config_map=k8s.V1ConfigMapVolumeSource(
                name="batchinfer-templates"))],
            volume_mounts=[k8s.V1VolumeMount(name="templates", mount_path="/templates", read_only=True)],
            execution_timeout=dt.timedelta(seconds=TIMEOUT_S + 1800),
            get_logs=True,
        )
    else:
        try:  # Airflow 3 moved the operator to the standard provider
            from airflow.providers.standard.operators.bash import BashOperator
        except ImportError:  # Airflow 2
            from airflow.operators.bash import BashOperator

        template = str(Path(__file__).with_name("summarise.jinja"))
        BashOperator(
            task_id="enrich_events",
            bash_command=shlex.join(["batchinfer", *nightly_args(template)]),
            env=ENV,
            append_env=True,
            execution_timeout=dt.timedelta(seconds=TIMEOUT_S + 1800),
        )
