"""An S3 API on loopback (moto's server) and what a daily run asks of it: `kfed-spark bench-s3`.

The server logs every request it answers, so the requests of one run are the log's lines between the run's
start and end, counted by where they go (a table's Delta log or its data files, the input, the reports) and
by kind: LIST (ListObjectsV2), HEAD, GET, PUT, POST (multipart uploads, batch deletes) and DELETE. The tests
of object storage start the same server (tests/test_object_store.py, tests/test_cluster.py).
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

import yaml

from kfed_spark.errors import KFedError

BUCKET = "kfed"
KEYS = {"access.key": "loopback", "secret.key": "loopback-secret"}
REQUEST_LINE = re.compile(r'"(GET|PUT|HEAD|POST|DELETE) (\S+) HTTP')


@dataclass(frozen=True)
class LoopbackS3:
    """An S3 API on 127.0.0.1 with one bucket, the settings each client needs to reach it, and the server's
    request log."""

    endpoint: str
    log: Path

    def url(self, key: str) -> str:
        return f"s3a://{BUCKET}/{key}"

    def s3a_settings(self) -> dict[str, str]:
        """Hadoop's S3A settings for the bucket (spark.hadoop.<key> in a Spark config)."""
        settings = {"endpoint": self.endpoint, "path.style.access": "true", "endpoint.region": "us-east-1", **KEYS}
        return {f"fs.s3a.{key}": value for key, value in settings.items()}

    def config(self, template: Path, input_path: str, out: str, target: Path) -> Path:
        """The template config with its input and output in the bucket, and S3A's settings for the bucket as
        a user's config holds them: every command, `report` and `sql` too, reads them from the file."""
        cfg = yaml.safe_load(template.read_text())
        cfg["input"]["path"], cfg["output"]["path"] = input_path, out
        spark = cfg.setdefault("spark", {})
        spark.setdefault("conf", {}).update(
            {f"spark.hadoop.{key}": value for key, value in self.s3a_settings().items()}
        )
        target.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return target

    @property
    def storage_options(self) -> dict[str, str]:
        """delta-rs's options for the same bucket."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": KEYS["access.key"],
            "AWS_SECRET_ACCESS_KEY": KEYS["secret.key"],
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=KEYS["access.key"],
            aws_secret_access_key=KEYS["secret.key"],
            region_name="us-east-1",
        )

    def keys(self, prefix: str) -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def upload(self, folder: Path, prefix: str) -> str:
        """Every file under folder to the bucket under prefix; the prefix's s3a:// URL."""
        client = self.client()
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(folder)}")
        return self.url(prefix)

    def requests_so_far(self) -> int:
        return len(self.log.read_text().splitlines())


@contextmanager
def loopback_s3(folder: Path, timeout: float = 60.0) -> Iterator[LoopbackS3]:
    """moto's S3 server on a free port of 127.0.0.1, logging to folder/moto.log, with the BUCKET created;
    stopped by pid on the way out."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = folder / "moto.log"
    command = [sys.executable, "-m", "moto.server", "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env={"PATH": "/usr/bin:/bin"})
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise KFedError(f"moto's S3 server did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.3)
        store = LoopbackS3(f"http://127.0.0.1:{port}", log)
        store.client().create_bucket(Bucket=BUCKET)
        yield store
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


def request_counts(lines: list[str], out_prefix: str) -> Counter:
    """(where, kind) -> requests, from the server's log lines: `where` is '<table> log' or '<table> data' for
    keys under out_prefix/<table>/, the first folder of other keys (the input's, the reports'), '(bucket)' for
    requests on the bucket itself."""
    counts: Counter = Counter()
    for line in lines:
        found = REQUEST_LINE.search(line)
        if not found:
            continue
        method, target = found.groups()
        parsed = urlparse(target)
        query = parse_qs(parsed.query, keep_blank_values=True)
        key = unquote(parsed.path).lstrip("/").partition("/")[2]
        if method == "GET" and "list-type" in query:
            method, key = "LIST", unquote(query.get("prefix", [""])[0])
        counts[(where(key, out_prefix), method)] += 1
    return counts


def where(key: str, out_prefix: str) -> str:
    """What a key belongs to, for request_counts."""
    if not key:
        return "(bucket)"
    if key.rstrip("/") == out_prefix:
        return "(output folder)"
    if not key.startswith(f"{out_prefix}/"):
        return key.split("/")[0]
    rest = key[len(out_prefix) + 1 :]
    first = rest.split("/")[0]
    if first.startswith(".kfed-write-check"):
        return "(write check)"
    if first == "reports":
        return first
    return f"{first} {'log' if '/_delta_log/' in f'/{rest}' else 'data'}"


def requests_table(counts: Counter) -> str:
    """The counts as a markdown table, a row per place, a column per price class of S3's requests (LIST; PUT
    and POST, which uploads' parts and batch deletes are; GET and HEAD; DELETE), with totals."""
    columns = {"LIST": ("LIST",), "PUT, POST": ("PUT", "POST"), "GET, HEAD": ("GET", "HEAD"), "DELETE": ("DELETE",)}
    places = sorted({place for place, _ in counts})
    header = "| requests to | " + " | ".join(columns) + " | all |\n| --- |" + " ---: |" * (len(columns) + 1) + "\n"
    rows = []
    for place in [*places, "all"]:
        values = [
            sum(v for (p, k), v in counts.items() if k in kinds and place in (p, "all")) for kinds in columns.values()
        ]
        rows.append(f"| {place} | " + " | ".join(str(v) for v in values) + f" | {sum(values)} |")
    return header + "\n".join(rows) + "\n"


S3_SHAPE = dict(k=16, k_per_device=4, devices=200, points_per_device=100, dim=16, seed=0)
"""The table of `bench-s3`: the requests depend on the tables and commits, hardly on the rows."""


def bench_s3_requests(out: Path, command: str) -> str:
    """A first run into the loopback bucket (untimed, uncounted), then a daily run whose requests are counted;
    the page's markdown."""
    from kfed_spark.bench.processes import kfed_command
    from kfed_spark.bench.synthetic import write_mixture

    out.mkdir(parents=True, exist_ok=True)
    write_mixture(out / "input", **S3_SHAPE)
    template = out / "template.yaml"
    template.write_text(
        yaml.safe_dump(
            {
                "input": {"path": "", "format": "parquet", "truth_col": "true_cluster"},
                "output": {"path": ""},
                "k": S3_SHAPE["k"],
                "k_per_device": S3_SHAPE["k_per_device"],
                "seed": 0,
                "spark": {"master": "local[2]", "conf": {"spark.ui.showConsoleProgress": "false"}},
            }
        )
    )
    with loopback_s3(out) as s3:
        config = s3.config(template, s3.upload(out / "input", "input"), s3.url("kfed"), out / "bucket.yaml")
        counted = {}
        for run_id in ("first", "daily"):
            before = s3.requests_so_far()
            ran = subprocess.run(
                [*kfed_command(), "run", "--config", str(config), "--set", f"run_id={run_id}", "--quiet"],
                capture_output=True,
                text=True,
            )
            if ran.returncode != 0:
                raise KFedError(f"the {run_id} run on the bucket failed: {ran.stderr.strip().splitlines()[-1:]}")
            counted[run_id] = request_counts(s3.log.read_text().splitlines()[before:], "kfed")
    shape = ", ".join(f"{key} = {value}" for key, value in S3_SHAPE.items())
    daily, first = counted["daily"], counted["first"]
    return (
        "## The requests of one daily run\n\n"
        f"A table of {S3_SHAPE['devices'] * S3_SHAPE['points_per_device']:,} rows ({shape}) in the bucket of moto's "
        "S3 server on 127.0.0.1; a first run created the tables, then a daily run (a new run id into the same "
        f"location) was counted; each a `kfed-spark run` process. `{command}`\n\n"
        + requests_table(daily)
        + f"\nThe first run, which also creates the seven tables, made {sum(first.values())} requests.\n"
    )
