"""Manifests of partitioned outputs: unit ids, fingerprints, the JSON form, atomic writes, reading back."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow.fs as pafs
import pytest

from batchinfer.datasets.manifest import (
    MANIFEST_DIR,
    InputSpan,
    Manifest,
    OutputFile,
    fingerprint,
    manifest_path,
    read_manifest,
    read_manifests,
    unit_id,
    write_manifest,
)
from batchinfer.protocol.entries import valid_job_id


@dataclass(frozen=True)
class File:  # what DatasetFile offers the fingerprint
    relative: str
    size: int | None


def _manifest(unit: str = "u1", job: str = "job-1") -> Manifest:
    return Manifest(unit=unit, fingerprint=fingerprint([File("date=2026-12-03/a.parquet", 10)]), job_id=job,
                    input="s3://lake/events", inputs=[{"location": "s3://lake/events/date=2026-12-03/a.parquet",
                                                       "relative": "date=2026-12-03/a.parquet", "size": 10}],
                    outputs=[OutputFile("date=2026-12-03/part-u1.parquet", {"date": "2026-12-03"}, 3,
                                        [InputSpan("s3://lake/events/date=2026-12-03/a.parquet", 3, 1, 5)])],
                    model="m", written_at=1_700_000_000_000)


def test_unit_ids_are_stable_short_and_job_id_like():
    a = unit_id(["s3://lake/events", "date=2026-12-03/a.parquet"])
    assert a == unit_id(["s3://lake/events", "date=2026-12-03/a.parquet"])
    assert len(a) == 16 and valid_job_id(a) and all(c in "0123456789abcdef" for c in a)
    assert a != unit_id(["s3://lake/events", "date=2026-12-04/a.parquet"])
    assert unit_id(["a", "b"]) != unit_id(["a\nb", ""])  # the joined text, not just the parts, decides


def test_fingerprint_takes_objects_or_dicts_in_any_order_and_sees_sizes():
    files = [File("b.parquet", 20), File("a.parquet", 10)]
    dicts = [{"relative": "a.parquet", "size": 10}, {"relative": "b.parquet", "size": 20}]
    assert fingerprint(files) == fingerprint(dicts) == fingerprint(reversed(files))
    assert len(fingerprint(files)) == 16
    assert fingerprint(files) != fingerprint([File("b.parquet", 21), File("a.parquet", 10)])  # rewritten
    assert fingerprint(files) != fingerprint(files[:1])  # one removed
    assert fingerprint([File("x", None)]) != fingerprint([File("x", 0)])


def test_json_round_trip_and_bad_manifests():
    m = _manifest()
    back = Manifest.from_json(m.to_json())
    assert back == m and isinstance(back.outputs[0].inputs[0], InputSpan)
    assert json.loads(m.to_json())["version"] == 1
    for bad, why in [("[]", "not a JSON object"), ("{", "not JSON"), ('{"version": 2}', "version"),
                     (json.dumps({**json.loads(m.to_json()), "outputs": [{"path": "x"}]}), "lacks"),
                     (json.dumps({**json.loads(m.to_json()), "unit": "../x"}), "unit")]:
        with pytest.raises(ValueError, match=why):
            Manifest.from_json(bad)


def test_manifest_path_refuses_a_unit_that_is_no_file_name():
    assert manifest_path("bucket/out/", "u1") == f"bucket/out/{MANIFEST_DIR}/u1.json"
    with pytest.raises(ValueError, match="invalid"):
        manifest_path("bucket/out", "../../etc")


def test_write_then_read_locally(tmp_path, caplog):
    fs = pafs.LocalFileSystem()
    root = str(tmp_path / "out")
    assert read_manifests(fs, root) == {} and read_manifest(fs, root, "u1") is None  # no root yet
    path = write_manifest(fs, root, _manifest("u1"))
    assert path == f"{root}/_manifests/u1.json"
    write_manifest(fs, root, _manifest("u2", job="job-2"))
    write_manifest(fs, root, _manifest("u1", job="job-3"))  # a re-run replaces the unit's manifest
    assert sorted(p.name for p in (tmp_path / "out" / MANIFEST_DIR).iterdir()) == ["u1.json", "u2.json"]
    found = read_manifests(fs, root)
    assert sorted(found) == ["u1", "u2"] and found["u1"].job_id == "job-3"
    assert read_manifest(fs, root, "u2").job_id == "job-2"
    # a corrupt manifest and a writer's temporary file are skipped; the rest still reads
    (tmp_path / "out" / MANIFEST_DIR / "bad.json").write_text("{not json")
    (tmp_path / "out" / MANIFEST_DIR / ".u3.abc.tmp").write_text(_manifest("u3").to_json())
    assert sorted(read_manifests(fs, root)) == ["u1", "u2"]
    assert "bad.json" in caplog.text


def test_a_failed_write_leaves_the_previous_manifest(tmp_path, monkeypatch):
    fs = pafs.LocalFileSystem()
    root = str(tmp_path / "out")
    write_manifest(fs, root, _manifest("u1", job="old"))

    def broken(self):
        raise RuntimeError("disk full")

    monkeypatch.setattr(Manifest, "to_json", broken)
    with pytest.raises(RuntimeError):
        write_manifest(fs, root, _manifest("u1", job="new"))
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "out" / MANIFEST_DIR).iterdir()] == ["u1.json"]  # no temp left
    assert read_manifest(fs, root, "u1").job_id == "old"


def test_write_then_read_on_s3(s3_server, monkeypatch):
    from batchinfer.datasets.uris import filesystem_for

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    s3_server.make_bucket("manifests")
    fs, root = filesystem_for("s3://manifests/enriched")
    write_manifest(fs, root, _manifest("u1"))
    # pyarrow's folder markers ("enriched/") aside, the one object is the manifest
    objects = [k for k in s3_server.object_keys("manifests") if not k.endswith("/")]
    assert objects == ["enriched/_manifests/u1.json"]
    assert read_manifests(fs, root)["u1"] == _manifest("u1")
    assert read_manifest(fs, root, "nope") is None
