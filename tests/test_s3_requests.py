"""Counting an S3 server's requests by where they go and their kind (kfed-spark bench-s3), from log lines
as moto's server writes them."""

import pytest

from kfed_spark.bench.object_store import request_counts, requests_table

pytestmark = pytest.mark.fast

LINES = [
    '127.0.0.1 - - [06/Dec/2026 03:35:12] "GET /kfed?list-type=2&delimiter=/&max-keys=2&prefix=in/ HTTP/1.1" 200 -',
    '127.0.0.1 - - [06/Dec/2026 03:35:12] "HEAD /kfed/in/part-0.parquet HTTP/1.1" 200 -',
    '127.0.0.1 - - [06/Dec/2026 03:35:13] "GET /kfed?list-type=2&prefix=out%2Flabels%2F_delta_log%2F HTTP/1.1" 200 -',
    '127.0.0.1 - - [06/Dec/2026 03:35:13] "PUT /kfed/out/labels/_delta_log/00000000000000000003.json HTTP/1.1" 200 -',
    '127.0.0.1 - - [06/Dec/2026 03:35:13] "PUT /kfed/out/labels/run_id%3Dd/part-0.parquet HTTP/1.1" 200 -',
    '127.0.0.1 - - [06/Dec/2026 03:35:14] "POST /kfed/out/reports/d/a/report.json?uploads HTTP/1.1" 200 -',
    '127.0.0.1 - - [06/Dec/2026 03:35:14] "HEAD /kfed HTTP/1.1" 200 -',
    " * Running on http://127.0.0.1:5000",
]


def test_requests_are_counted_by_table_log_or_data_and_kind():
    counts = request_counts(LINES, "out")
    assert counts == {
        ("in", "LIST"): 1,
        ("in", "HEAD"): 1,
        ("labels log", "LIST"): 1,
        ("labels log", "PUT"): 1,
        ("labels data", "PUT"): 1,
        ("reports", "POST"): 1,
        ("(bucket)", "HEAD"): 1,
    }
    table = requests_table(counts)
    assert "| labels log | 1 | 1 | 0 | 0 | 2 |" in table
    assert table.splitlines()[-1] == "| all | 2 | 3 | 2 | 0 | 7 |"
