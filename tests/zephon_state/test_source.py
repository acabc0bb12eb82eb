"""zephon_state sources: JSON Lines (plain, gz, zst), text files, in-memory lists, s3 through moto;
bad records counted and reported, or raised."""
import gzip
import logging
from pathlib import Path

import orjson
import pytest
import zstandard

from zephon_state import BadRecordError, InMemory, IoOptions, JsonLines, TextFiles
from zephon_state.source import as_source

CORPUS = Path(__file__).resolve().parents[2] / "src" / "flextrain" / "corpus"
RECORDS = [{"id": i, "text": f"document number {i}"} for i in range(5)]


def _jsonl(records) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in records)


def _texts(docs):
    return list(docs.texts)


def test_jsonl_plain_gzip_and_zstd_read_the_same_documents(tmp_path):
    raw = _jsonl(RECORDS)
    (tmp_path / "a.jsonl").write_bytes(raw)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    loaded = [JsonLines(str(tmp_path / n)).load("text", IoOptions(), "count") for n in ("a.jsonl", "a.jsonl.gz", "a.jsonl.zst")]
    for docs in loaded:
        assert _texts(docs) == [f"document number {i}" for i in range(5)]
        assert docs.nbytes.tolist() == [17] * 5
        assert docs.name == "a"
    assert loaded[0].sha256 == loaded[1].sha256 == loaded[2].sha256


def test_the_shipped_corpora_hold_their_documented_document_counts():
    kjv = JsonLines(str(CORPUS / "kjv.jsonl.zst")).load("text", IoOptions(), "raise")
    code = JsonLines(str(CORPUS / "python_stdlib.jsonl.zst")).load("text", IoOptions(), "raise")
    assert (len(kjv), len(code)) == (1039, 168)
    assert (kjv.report.bytes, code.report.bytes) == (4298588, 4698388)  # UTF-8 bytes of the texts


def test_bad_records_are_counted_per_reason_reported_and_logged(tmp_path, caplog):
    lines = [b'{"text": "good one"}', b"{not json", b"[1, 2]", b'{"body": "x"}', b'{"text": 7}', b"", b'{"text": "good two"}']
    (tmp_path / "bad.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with caplog.at_level(logging.WARNING, logger="zephon_state.source"):
        docs = JsonLines(str(tmp_path / "bad.jsonl")).load("text", IoOptions(), "count")
    assert _texts(docs) == ["good one", "good two"]
    assert docs.report.bad == {"invalid_json": 1, "not_an_object": 1, "missing_field": 1, "not_a_string": 1}
    assert docs.report.bad_total == 4
    assert docs.report.examples[0].endswith("bad.jsonl:2: is not valid JSON")
    assert docs.report.examples[2].endswith("bad.jsonl:4: has no field 'text'")
    assert "skipped 4 bad records" in caplog.text


def test_bad_record_policy_raise_stops_at_the_record_naming_file_line_and_fix(tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": null}\n')
    with pytest.raises(BadRecordError, match=r"bad.jsonl:2 has a field 'text' that is not a string; .*bad_records='count'"):
        JsonLines(str(tmp_path / "bad.jsonl")).load("text", IoOptions(), "raise")


def test_text_files_give_one_document_per_file_or_per_line_in_sorted_glob_order(tmp_path):
    (tmp_path / "b.txt").write_text("second file\nits line two\n")
    (tmp_path / "a.txt").write_text("first file")
    (tmp_path / "c.txt").write_bytes(b"\xff\xfe broken")
    per_file = TextFiles(str(tmp_path / "*.txt")).load("text", IoOptions(), "count")
    assert _texts(per_file) == ["first file", "second file\nits line two\n"]
    assert per_file.report.bad == {"not_utf8": 1}
    per_line = TextFiles([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], unit="line").load("text", IoOptions(), "count")
    assert _texts(per_line) == ["first file", "second file", "its line two"]


def test_in_memory_lists_of_texts_or_records_and_path_inference(tmp_path):
    assert _texts(InMemory(["a", "b"]).load("text", IoOptions(), "count")) == ["a", "b"]
    mixed = InMemory([{"content": "x"}, {"content": 1}], field="content").load("text", IoOptions(), "count")
    assert _texts(mixed) == ["x"] and mixed.report.bad == {"not_a_string": 1}
    assert isinstance(as_source("x/y.jsonl.zst"), JsonLines)
    assert isinstance(as_source("x/y.txt"), TextFiles)
    assert isinstance(as_source(["text"]), InMemory)


def test_s3_jsonl_zst_reads_like_local_and_the_cache_keeps_a_local_copy(s3_endpoint, tmp_path):
    # s3_endpoint (tests/conftest.py): a moto S3 server in its own process, on a free port
    import s3fs

    storage = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": s3_endpoint}}
    fs = s3fs.S3FileSystem(**storage)
    fs.mkdir("zephon-data")
    raw = zstandard.ZstdCompressor().compress(_jsonl(RECORDS))
    for name in ("part-1.jsonl.zst", "part-0.jsonl.zst"):
        with fs.open(f"zephon-data/{name}", "wb") as f:
            f.write(raw)
    cache = tmp_path / "cache"
    io = IoOptions.from_value({"storage_options": storage, "cache": {"enabled": True, "dir": str(cache)}})
    docs = JsonLines("s3://zephon-data/part-*.jsonl.zst").load("text", io, "raise")
    assert _texts(docs) == [f"document number {i}" for i in range(5)] * 2
    assert len([p for p in cache.iterdir() if p.is_file() and p.name != "cache"]) == 2
    (tmp_path / "local.jsonl.zst").write_bytes(raw)
    local = JsonLines([str(tmp_path / "local.jsonl.zst")] * 2).load("text", IoOptions(), "raise")
    assert local.sha256 == docs.sha256


def test_the_pipeline_reports_bad_records_per_source_or_stops_at_start_with_the_raise_policy(tmp_path):
    from zephon_state import Pipeline

    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "one"}\n{"text": "two"}\n{"txt": "three"}\n')
    with Pipeline(str(tmp_path / "bad.jsonl")).tokenize().pack_flat(8).batch(1) as p:
        (report,) = p.report()
        assert (report.name, report.documents, report.bad) == ("bad", 2, {"missing_field": 1})
    strict = Pipeline(str(tmp_path / "bad.jsonl")).options(bad_records="raise").tokenize().pack_flat(8).batch(1)
    with pytest.raises(BadRecordError, match=r"bad.jsonl:3 has no field 'text'"):
        strict.fingerprint()
    strict.close()
