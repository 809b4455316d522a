"""DatasetSource on an S3-compatible server (moto's, tests/s3_server.py) through ``s3://`` and the
standard AWS environment: a Hive dataset written there with pyarrow is listed, pruned and scanned;
an unreachable endpoint, a missing bucket or key and wrong credentials each give their own sentence.

Wrong credentials fail for real: moto checks signatures and IAM policies once its authentication is
switched on (``POST /moto-api/reset-auth`` with the number of requests still let through: 0); the
``moto_auth`` fixture switches it on for one test and back off after.
"""

from __future__ import annotations

import json
import socket
import urllib.request
import uuid

import boto3
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from batchinfer.datasets.source import DatasetSource, InputError
from batchinfer.datasets.uris import filesystem_for, location_of

DATES = ("2026-12-01", "2026-12-02", "2026-12-03")
ROWS = 30


@pytest.fixture(scope="module")
def bucket(s3_server) -> str:
    """A bucket holding events/date=<d>/part-0.parquet for three dates, and events/_manifests/x.json."""
    name = f"lake-{uuid.uuid4().hex[:10]}"
    s3_server.make_bucket(name)
    fs = pafs.S3FileSystem(endpoint_override=s3_server.endpoint, access_key="testing", secret_key="testing",
                           region="us-east-1")
    for i, date in enumerate(DATES):
        table = pa.table({"id": [i * 1000 + n for n in range(1, ROWS + 1)], "n": list(range(1, ROWS + 1))})
        with fs.open_output_stream(f"{name}/events/date={date}/part-0.parquet") as out:
            pq.write_table(table, out, row_group_size=8)
    with fs.open_output_stream(f"{name}/events/_manifests/x.json") as out:
        out.write(json.dumps({"unit": "x"}).encode())
    return name


@pytest.fixture
def aws(s3_server, monkeypatch):
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_REGION", raising=False)
    return monkeypatch


def test_a_hive_dataset_in_a_bucket(bucket, aws):
    source = DatasetSource(f"s3://{bucket}/events/")
    files = source.files()
    assert [f.location for f in files] == [f"s3://{bucket}/events/date={d}/part-0.parquet" for d in DATES]
    assert [f.relative for f in files] == [f"date={d}/part-0.parquet" for d in DATES]
    assert [f.partition for f in files] == [{"date": d} for d in DATES]
    assert all(f.size and f.size > 100 for f in files)
    assert (source.name, source.root, source.partition_keys) == ("events", f"s3://{bucket}/events", ["date"])
    rows = [(b.file.partition["date"], n, number) for b in source.scan(batch_rows=5)
            for n, number in zip(b.rows.column("n").to_pylist(), b.row_numbers.to_pylist(), strict=True)]
    assert len(rows) == 3 * ROWS and all(n == number for _, n, number in rows)
    assert sorted({d for d, _, _ in rows}) == list(DATES)


def test_partition_pruning_and_row_filters_on_s3(bucket, aws):
    source = DatasetSource(f"s3://{bucket}/events", where="date = '2026-12-02' AND n > 27")
    assert [f.relative for f in source.files()] == ["date=2026-12-02/part-0.parquet"]
    batches = list(source.scan(["id", "date"]))
    assert [i for b in batches for i in b.rows.column("id").to_pylist()] == [1028, 1029, 1030]
    assert [n for b in batches for n in b.row_numbers.to_pylist()] == [28, 29, 30]
    with pytest.raises(InputError, match=f"matches no file of s3://{bucket}/events"):
        DatasetSource(f"s3://{bucket}/events", partitions=["date=2030-01-01"]).files()


def test_globs_single_files_and_lists_on_s3(bucket, aws):
    glob = DatasetSource(f"s3://{bucket}/events/date=2026-12-0[23]/*.parquet")
    assert [f.partition["date"] for f in glob.files()] == ["2026-12-02", "2026-12-03"]
    assert glob.root == f"s3://{bucket}/events"
    one = DatasetSource(f"s3://{bucket}/events/date=2026-12-01/part-0.parquet")
    assert [(f.relative, f.partition) for f in one.files()] == [("part-0.parquet", {})]
    assert sum(b.rows.num_rows for b in one.scan()) == ROWS
    listed = DatasetSource([f"s3://{bucket}/events/date={d}/part-0.parquet" for d in DATES[1:]])
    assert [f.relative for f in listed.files()] == [f"date={d}/part-0.parquet" for d in DATES[1:]]
    assert sum(b.rows.num_rows for b in listed.scan()) == 2 * ROWS


def test_the_service_specific_endpoint_variable(bucket, aws, s3_server):
    aws.delenv("AWS_ENDPOINT_URL")
    aws.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)
    fs, path = filesystem_for(f"s3://{bucket}/events")
    assert path == f"{bucket}/events" and location_of(fs, path) == f"s3://{bucket}/events"
    assert len(DatasetSource(f"s3://{bucket}/events").files()) == 3


def test_a_missing_key_and_a_missing_bucket(bucket, aws):
    with pytest.raises(InputError, match=f"^s3://{bucket}/nothere does not exist$"):
        DatasetSource(f"s3://{bucket}/nothere").files()
    with pytest.raises(InputError, match=f"s3://{bucket}/nothere.*does not exist"):
        DatasetSource(f"s3://{bucket}/nothere/*.parquet").files()
    with pytest.raises(InputError, match="^no such bucket 'no-such-bucket-x': s3://no-such-bucket-x/events"):
        DatasetSource("s3://no-such-bucket-x/events").files()


def test_an_unreachable_endpoint(aws):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    aws.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    aws.setenv("AWS_MAX_ATTEMPTS", "1")  # no retries: the test stays fast
    with pytest.raises(InputError) as info:
        DatasetSource("s3://lake/events").files()
    assert str(info.value) == (f"cannot reach the object store at 127.0.0.1:{port} holding s3://lake/events "
                               "(check AWS_ENDPOINT_URL and the network)")
    aws.setenv("AWS_ENDPOINT_URL", "http://no-such-host.invalid:9000")  # a name no resolver knows
    with pytest.raises(InputError, match="^cannot reach the object store at no-such-host.invalid holding"):
        DatasetSource("s3://lake/events").files()


def _moto_auth(endpoint: str, requests_let_through: str) -> None:
    request = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=requests_let_through.encode(),
                                     method="POST", headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(request, timeout=10).close()


@pytest.fixture
def moto_auth(s3_server, bucket):
    """Two IAM users (``reader`` may use S3, ``nobody`` may not) and moto's authentication on for the
    test: {user: (access key id, secret)}."""
    iam = boto3.client("iam", endpoint_url=s3_server.endpoint, region_name="us-east-1",
                       aws_access_key_id="testing", aws_secret_access_key="testing")
    keys = {}
    for user in ("reader", "nobody"):
        name = f"{user}-{uuid.uuid4().hex[:8]}"
        iam.create_user(UserName=name)
        key = iam.create_access_key(UserName=name)["AccessKey"]
        keys[user] = (key["AccessKeyId"], key["SecretAccessKey"])
        if user == "reader":
            allow = {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}
            iam.put_user_policy(UserName=name, PolicyName="s3",
                                PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [allow]}))
    _moto_auth(s3_server.endpoint, "0")
    try:
        yield keys
    finally:
        _moto_auth(s3_server.endpoint, "inf")


def test_wrong_credentials(bucket, aws, moto_auth):
    location = f"s3://{bucket}/events"
    key_id, secret = moto_auth["reader"]
    aws.setenv("AWS_ACCESS_KEY_ID", key_id)
    aws.setenv("AWS_SECRET_ACCESS_KEY", secret)
    assert len(DatasetSource(location).files()) == 3  # the right credentials still read
    aws.setenv("AWS_SECRET_ACCESS_KEY", "wrong" + secret)
    with pytest.raises(InputError, match=f"^access to {location} denied: the secret key does not match"):
        DatasetSource(location).files()
    aws.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
    with pytest.raises(InputError, match=f"^access to {location} denied: the store does not know this"):
        DatasetSource(location).files()
    key_id, secret = moto_auth["nobody"]
    aws.setenv("AWS_ACCESS_KEY_ID", key_id)
    aws.setenv("AWS_SECRET_ACCESS_KEY", secret)
    with pytest.raises(InputError, match=f"^access to {location} denied: wrong credentials or no permission"):
        DatasetSource(location).files()
