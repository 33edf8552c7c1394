"""Linear algebra and seeded draws that every k-FED kernel shares: numpy, no Spark.

Squared distances are computed as |x|^2 - 2 x.c + |c|^2 (one matrix product), whose rounding error
grows with the rows' distance from the origin, not with their spread: at 1e9 from the origin it
swamps distances of 1. So every kernel first moves its rows near the origin (by their mean, or the
centers' mean) and moves its centers back at the end; every cut-off is then relative to the rows'
spread, and shifting or scaling the features changes no label.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Protocol

import numpy as np

RANDOMIZED_SVD_MIN_DIM = 512
"""Devices with at least this many features use a seeded randomized SVD instead of an exact one."""


DUPLICATE_TOLERANCE = 1e-12
"""Squared distances below this fraction of the largest squared distance from the rows' mean are
rounding residue of equal rows, not distance."""


DISTANCE_CHUNK_ELEMENTS = 1 << 22
"""Distance matrices are built in row chunks of at most this many entries (32 MiB of float64)."""


def device_rng(seed: int, device_id: object) -> np.random.Generator:
    """A generator seeded from (run seed, device id) alone, so partitioning and retries do not matter: PCG64
    from a SeedSequence of [seed low, seed high, *_device_words], which device_uniforms repeats for many devices."""
    return np.random.Generator(np.random.PCG64([*_seed_words(seed), *_device_words(device_id)]))


def device_uniforms(seed: int, device_ids: np.ndarray, n: int) -> np.ndarray:
    """(len(device_ids), n): row i holds device_rng(seed, device_ids[i]).random(n), bit for bit, computed for
    all the devices at once. Creating one generator costs more than clustering a 10-row device, so the seeding
    and the first draws run here as array arithmetic over the devices: the SeedSequence mixing and the PCG64
    steps numpy runs for one generator, on 32-bit words and 128-bit numbers held in uint64 arrays."""
    seeded, increment = _device_rng_states(seed, device_ids)
    # Draw j (from 1) is the output of the state j steps on: seeded * M^j + increment * (1 + M + ... + M^(j-1)).
    powers, sums = _lcg_jumps(n)
    seeded, increment = (seeded[0][:, None], seeded[1][:, None]), (increment[0][:, None], increment[1][:, None])
    states = _added(_times(seeded, powers), _times(increment, sums))  # (devices, n)
    folded, turn = states[0] ^ states[1], states[0] >> np.uint64(58)  # XSL-RR: the halves xor-ed, rotated right
    output = (folded >> turn) | (folded << ((np.uint64(64) - turn) & np.uint64(63)))
    return (output >> np.uint64(11)) * 2.0**-53  # a double from the output's top 53 bits


def device_normals(seed: int, device_ids: np.ndarray, n: int) -> np.ndarray:
    """(len(device_ids), n): row i holds device_rng(seed, device_ids[i]).standard_normal(n), bit for bit: the
    generators' states computed for all the devices at once (device_uniforms), the draws by numpy from each."""
    return _normals(_device_rng_states(seed, device_ids), n)


def noise_normals(noise_key: int, device_ids: np.ndarray, n: int) -> np.ndarray:
    """(len(device_ids), n): row i holds noise_rng(noise_key, device_ids[i]).standard_normal(n), bit for bit
    (device_normals)."""
    return _normals(_seeded_pcg64(_key_words(noise_key), device_ids), n)


def _device_rng_states(seed: int, device_ids: np.ndarray) -> tuple[Wide, Wide]:
    """The (state, increment) of device_rng(seed, id) for every id."""
    return _seeded_pcg64(_seed_words(seed), device_ids)


def _seeded_pcg64(leading: list[int], device_ids: np.ndarray) -> tuple[Wide, Wide]:
    """The (state, increment) of PCG64(SeedSequence([*leading, *_device_words(id)])) for every id, as numpy seeds
    it: leading holds at least two 32-bit words, and numpy takes a key of 2^32 or more as two words."""
    device_ids = np.asarray(device_ids)
    if np.issubdtype(device_ids.dtype, np.integer):  # _device_words of integers: tag 0, the two's complement
        tags, keys = np.zeros(len(device_ids), np.uint64), device_ids.astype(np.int64).view(np.uint64)
    else:
        tags, keys = np.asarray([_device_words(plain(device)) for device in device_ids], np.uint64).reshape(-1, 2).T
    words = [np.full(len(keys), word, np.uint64) for word in leading]
    high = keys >> np.uint64(32)
    state = _pool_state(_seed_pool([*words, tags, keys & _MASK32], high, high > 0))  # initial state, stream
    # PCG64's seeding: state 0 and increment (stream << 1) | 1, a step (the state becomes the increment), the
    # initial state added, a step.
    increment = ((state[2] << np.uint64(1)) | (state[3] >> np.uint64(63)), (state[3] << np.uint64(1)) | np.uint64(1))
    seeded = _added(_times(_added(increment, (state[0], state[1])), _wide([_PCG_MULTIPLIER])), increment)
    return seeded, increment


def _normals(states: tuple[Wide, Wide], n: int) -> np.ndarray:
    """(devices, n) standard normal draws, row i from a PCG64 generator in the i-th of states (numpy's sampler:
    setting a state costs a tenth of seeding a generator)."""
    bit_generator = np.random.PCG64(0)  # its state is set for each device
    generator = np.random.Generator(bit_generator)
    out = np.empty((len(states[0][0]), n))
    halves = zip(*(half.tolist() for pair in states for half in pair))  # each device's state and increment halves
    for row, (state_high, state_low, inc_high, inc_low) in zip(out, halves):
        bit_generator.state = {
            "bit_generator": "PCG64",
            "state": {"state": (state_high << 64) | state_low, "inc": (inc_high << 64) | inc_low},
            "has_uint32": 0,
            "uinteger": 0,
        }
        generator.standard_normal(out=row)
    return out


_MASK32 = np.uint64(0xFFFFFFFF)
_SEED_MIX_A, _SEED_MULT_A = 0x43B0D7E5, 0x931E8875  # SeedSequence's hash constants (entropy into the pool)
_SEED_MIX_B, _SEED_MULT_B = 0x8B51F9DD, 0x58F38DED  # (the pool into state words)
_MIX_LEFT, _MIX_RIGHT = np.uint64(0xCA01F9DD), np.uint64(0x4973F715)
_PCG_MULTIPLIER = (2549297995355413924 << 64) + 4865540595714422341

Wide = tuple[np.ndarray, np.ndarray]
"""128-bit numbers as their (high, low) 64-bit halves, arithmetic modulo 2^128."""


def _hash_constants(start: int, mult: int, count: int) -> list[np.uint64]:
    """The hash constant SeedSequence uses at each of its first `count` hashes (it is multiplied after each)."""
    found, value = [], start
    for _ in range(count):
        found.append(np.uint64(value))
        value = (value * mult) & 0xFFFFFFFF
    return found


def _hashed(value: np.ndarray, constant: np.uint64, mult: int) -> np.ndarray:
    """One SeedSequence hash of 32-bit words (held in uint64): xor the constant, multiply by the next, fold."""
    value = ((value ^ constant) * np.uint64((int(constant) * mult) & 0xFFFFFFFF)) & _MASK32
    return value ^ (value >> np.uint64(16))


def _mixed(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """SeedSequence's mix of two 32-bit words (held in uint64)."""
    result = np.bitwise_and(x * _MIX_LEFT - y * _MIX_RIGHT, _MASK32)
    return result ^ (result >> np.uint64(16))


def _seed_pool(words: list[np.ndarray], extra: np.ndarray, has_extra: np.ndarray) -> list[np.ndarray]:
    """SeedSequence's pool of four 32-bit words from at least four entropy words per device, and one more
    (extra) where has_extra."""
    constants = iter(_hash_constants(_SEED_MIX_A, _SEED_MULT_A, 4 + 12 + 4 * (len(words) - 4 + 1)))
    pool = [_hashed(word, next(constants), _SEED_MULT_A) for word in words[:4]]
    for source in range(4):
        for target in range(4):
            if source != target:
                pool[target] = _mixed(pool[target], _hashed(pool[source], next(constants), _SEED_MULT_A))
    for word in words[4:]:
        for target in range(4):
            pool[target] = _mixed(pool[target], _hashed(word, next(constants), _SEED_MULT_A))
    for target in range(4):
        pool[target] = np.where(
            has_extra, _mixed(pool[target], _hashed(extra, next(constants), _SEED_MULT_A)), pool[target]
        )
    return pool


def _pool_state(pool: list[np.ndarray]) -> list[np.ndarray]:
    """SeedSequence.generate_state(4, np.uint64) from each device's pool: eight 32-bit words, paired low first."""
    constants = _hash_constants(_SEED_MIX_B, _SEED_MULT_B, 8)
    halves = [_hashed(pool[i % 4], constants[i], _SEED_MULT_B) for i in range(8)]
    return [halves[2 * i] | (halves[2 * i + 1] << np.uint64(32)) for i in range(4)]


@functools.lru_cache(maxsize=16)
def _lcg_jumps(n: int) -> tuple[Wide, Wide]:
    """(M^j, 1 + M + ... + M^(j-1)) modulo 2^128 for j = 1 .. n, M PCG64's multiplier: a state j steps on is
    state * M^j + increment * the sum."""
    powers, sums, power, total = [], [], 1, 0
    for _ in range(n):
        total = (total + power) % 2**128
        power = (power * _PCG_MULTIPLIER) % 2**128
        powers.append(power)
        sums.append(total)
    return _wide(powers), _wide(sums)


def _wide(values: list[int]) -> Wide:
    """Python integers below 2^128 as Wide."""
    return np.array([v >> 64 for v in values], np.uint64), np.array([v & 0xFFFFFFFFFFFFFFFF for v in values], np.uint64)


def _added(a: Wide, b: Wide) -> Wide:
    """a + b modulo 2^128 (broadcasting): the low halves' carry goes to the high half."""
    low = a[1] + b[1]
    return a[0] + b[0] + (low < b[1]).astype(np.uint64), low


def _times(a: Wide, b: Wide) -> Wide:
    """a * b modulo 2^128 (broadcasting): the low halves' full product, plus the cross products' low halves."""
    a0, a1 = a[1] & _MASK32, a[1] >> np.uint64(32)
    b0, b1 = b[1] & _MASK32, b[1] >> np.uint64(32)
    low_low, low_high, high_low = a0 * b0, a0 * b1, a1 * b0
    middle = (low_low >> np.uint64(32)) + (low_high & _MASK32) + (high_low & _MASK32)
    carried = a1 * b1 + (low_high >> np.uint64(32)) + (high_low >> np.uint64(32)) + (middle >> np.uint64(32))
    return carried + a[1] * b[0] + a[0] * b[1], a[1] * b[1]


def noise_rng(noise_key: int, device_id: object) -> np.random.Generator:
    """The generator of a device's privacy noise: seeded from (the run's secret 128-bit noise key, device id).

    The one draw not seeded from the run seed: the seed is published in the runs table, and noise
    anyone can draw again is noise anyone can subtract."""
    return np.random.default_rng([*_key_words(noise_key), *_device_words(device_id)])


def _seed_words(seed: int) -> list[int]:
    """The run seed's entropy words ahead of a device's (device_rng, device_uniforms, device_normals)."""
    return [seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF]


def _key_words(noise_key: int) -> list[int]:
    """The 128-bit noise key's entropy words ahead of a device's (noise_rng, noise_normals)."""
    return [(noise_key >> shift) & 0xFFFFFFFF for shift in range(0, 128, 32)]


def _device_words(device_id: object) -> tuple[int, int]:
    """A device id as (tag, 64-bit key): integers as themselves, anything else by a hash of its text."""
    if isinstance(device_id, (int, np.integer)):
        return 0, int(device_id) & 0xFFFFFFFFFFFFFFFF
    digest = hashlib.blake2b(str(device_id).encode("utf-8"), digest_size=8).digest()
    return 1, int.from_bytes(digest, "little")


def plain(value: object) -> object:
    """A numpy scalar as the Python value it holds (for messages and results); others unchanged."""
    return value.item() if isinstance(value, np.generic) else value


def centered(x: np.ndarray, weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(x minus its (weighted) mean, the mean): rows near the origin, whose expanded squared distances
    are accurate to their spread (see the module's docstring)."""
    origin = x.mean(axis=0) if weights is None else (weights @ x) / weights.sum()
    return x - origin, origin


def distinct_rows(x: np.ndarray, owner: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct rows of each owner's rows (one owner if None), owner after owner and in
    lexicographic order within each, how often each occurs and its owner: per owner, what
    np.unique(x, axis=0, return_counts=True) returns, a tenth of its time on continuous features.

    Rows are sorted by (owner, first value); only runs of rows that tie on both are sorted and
    compared by all their values (where most rows tie, as on images whose first pixel is always 0,
    np.unique sorts every value once).
    """
    x = np.asarray(x, dtype=np.float64)
    owner = np.zeros(len(x), dtype=np.int64) if owner is None else np.asarray(owner, dtype=np.int64)
    if len(x) == 0:
        return x, np.zeros(0, dtype=np.int64), owner
    order = _by_owner_then_first_value(x[:, 0], owner)
    ordered, owned = x[order], owner[order]
    tied = (ordered[1:, 0] == ordered[:-1, 0]) & (owned[1:] == owned[:-1])
    if np.count_nonzero(tied) > len(x) // 2:
        keyed, counts = np.unique(np.column_stack([owner.astype(np.float64), x]), axis=0, return_counts=True)
        return np.ascontiguousarray(keyed[:, 1:]), counts, keyed[:, 0].astype(np.int64)
    if not tied.any():
        return ordered, np.ones(len(x), dtype=np.int64), owned
    in_run = np.zeros(len(x), dtype=bool)
    in_run[1:] |= tied
    in_run[:-1] |= tied
    run = np.cumsum(np.concatenate([[True], ~tied]))
    rows = np.flatnonzero(in_run)
    ordered[rows] = ordered[rows[np.lexsort((*ordered[rows, ::-1].T, run[rows]))]]  # last key first
    pairs = np.flatnonzero(tied)  # only neighbours that tie on (owner, first value) can be equal
    change = ~tied
    change[pairs] = np.any(ordered[pairs + 1] != ordered[pairs], axis=1)
    starts = np.flatnonzero(np.concatenate([[True], change]))
    return ordered[starts], np.diff(np.append(starts, len(x))), owned[starts]


def _by_owner_then_first_value(first: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """The order of rows by (owner, first value), rows that tie on both in no particular order (distinct_rows
    then sorts them by every value). Owners that fit 16 bits: one sort of the values, then a stable sort of the
    owners, a radix sort; np.lexsort's comparisons of the two keys cost about twice as much."""
    if owner.min() < 0 or owner.max() >= 1 << 16:
        return np.lexsort((first, owner))
    by_value = np.argsort(first)
    return by_value[np.argsort(owner[by_value].astype(np.uint16), kind="stable")]


def squared_distances(
    x: np.ndarray, centers: np.ndarray, x_sq: np.ndarray | None = None, c_sq: np.ndarray | None = None
) -> np.ndarray:
    """(n, k) squared Euclidean distances as |x|^2 - 2 x.c + |c|^2 (one matrix product), clipped at 0.

    Accurate to the rows' spread only for rows near the origin: callers pass centered() rows.
    x_sq and c_sq are the rows' squared norms, if the caller already has them.
    """
    x_sq = np.einsum("ij,ij->i", x, x) if x_sq is None else x_sq
    c_sq = np.einsum("ij,ij->i", centers, centers) if c_sq is None else c_sq
    dist = x @ centers.T
    dist *= -2.0
    dist += x_sq[:, None]
    dist += c_sq[None, :]
    np.maximum(dist, 0.0, out=dist)
    return dist


def nearest_center(x: np.ndarray, centers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index of and squared distance to the nearest center for every row, in bounded-memory chunks.

    Rows and centers are first moved by the centers' mean, so that the result is as accurate far
    from the origin as near it.
    """
    centers, origin = centered(centers)
    x = x - origin
    return nearest_with_norms(x, np.einsum("ij,ij->i", x, x), centers)


def nearest_with_norms(x: np.ndarray, x_sq: np.ndarray, centers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """nearest_center of rows x that are already near the origin, given their squared norms x_sq;
    centers may have a leading axis of restarts, (r, k, d), and so then do the results, (r, n)."""
    minus_twice = -2.0 * np.swapaxes(centers, -1, -2)  # scaling by -2 is exact: the same sums as -2 (x @ c)
    c_sq = np.einsum("...kd,...kd->...k", centers, centers)[..., None, :]
    step = max(1, DISTANCE_CHUNK_ELEMENTS // max(1, centers.shape[-2] * (centers.shape[0] if centers.ndim == 3 else 1)))
    parts = []
    for start in range(0, max(1, len(x)), step):  # one (empty) chunk for no rows
        # |c|^2 - 2 x.c orders the centers as the squared distance does; |x|^2 is added to the winner only.
        partial = x[start : start + step] @ minus_twice
        partial += c_sq
        nearest = np.argmin(partial, axis=-1)
        best = np.take_along_axis(partial, nearest[..., None], axis=-1)[..., 0]
        parts.append((nearest, best + x_sq[start : start + step]))
    if len(parts) == 1:
        nearest, best = parts[0]
    else:
        nearest, best = (np.concatenate([part[i] for part in parts], axis=-1) for i in (0, 1))
    return nearest, np.maximum(best, 0.0, out=best)


def weighted_means(x: np.ndarray, weights: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-label weighted sums divided by per-label weights; also returns the weights (0 for empty)."""
    sums, mass = weighted_sums(x, weights, labels, k)
    means = np.divide(sums, mass[:, None], out=np.zeros_like(sums), where=mass[:, None] > 0)
    return means, mass


def weighted_sums(x: np.ndarray, weights: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-label weighted sums of the rows, and per-label weights.

    The sums are matrix products with the (k, rows) matrix of the rows' weights by label, in row
    chunks of bounded size: a few numpy calls where a device has few rows.
    """
    mass = np.bincount(labels, weights=weights, minlength=k)
    sums = np.zeros((k, x.shape[1]))
    step = max(1, DISTANCE_CHUNK_ELEMENTS // max(1, k))
    for start in range(0, len(x), step):
        chunk = slice(start, start + step)
        by_label = np.zeros((k, len(x[chunk])))
        by_label[labels[chunk], np.arange(len(by_label[0]))] = weights[chunk]
        sums += by_label @ x[chunk]
    return sums, mass


class UniformDraws(Protocol):
    """Where kmeans_plusplus takes its uniform draws from: a numpy Generator, or draws made beforehand."""

    def random(self, size: int) -> np.ndarray: ...


def kmeans_plusplus(x: np.ndarray, weights: np.ndarray, k: int, rng: UniformDraws) -> np.ndarray:
    """Greedy k-means++ seeding over weighted rows; returns the chosen row indices.

    Each step draws 2 + log(k) candidates with probability proportional to weight times squared
    distance and keeps the one that lowers the potential most (Arthur and Vassilvitskii 2007,
    as scikit-learn does): single-draw k-means++ often puts two seeds in one cluster.
    """
    trials = 2 + int(np.log(k))
    x, _ = centered(x, weights)
    norms = np.einsum("ij,ij->i", x, x)
    # Squared distances up to this are rounding residue of equal rows: once every row is that close
    # to a seed, the distinct rows have run out.
    duplicate_below = DUPLICATE_TOLERANCE * float(np.max(norms))
    chosen = [_draw(np.cumsum(weights), rng, 1)[0]]
    closest = squared_distances(x[chosen], x, norms[chosen], norms)[0]
    for _ in range(1, k):
        if np.max(closest) <= duplicate_below:
            break
        candidates = _draw(np.cumsum(weights * closest), rng, trials)
        candidate_closest = np.minimum(closest[None, :], squared_distances(x[candidates], x, norms[candidates], norms))
        best = int(np.argmin(candidate_closest @ weights))
        chosen.append(int(candidates[best]))
        closest = candidate_closest[best]
    return np.asarray(chosen, dtype=np.int64)


def _draw(cumulative: np.ndarray, rng: UniformDraws, size: int) -> np.ndarray:
    """Indices drawn with probability proportional to the increments of cumulative."""
    picks = np.searchsorted(cumulative, rng.random(size) * cumulative[-1], side="right")
    return np.minimum(picks, len(cumulative) - 1)


def lloyd(
    x: np.ndarray,
    weights: np.ndarray,
    centers: np.ndarray,
    max_iter: int,
    tol: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Weighted Lloyd from the given centers until assignments stop changing.

    Also stops after max_iter rounds or once no center moves more than tol (squared, relative
    to the data's total variance, so that shifting the data does not change when it stops, as
    scikit-learn scales its tol). An emptied cluster keeps its previous center. The means are
    taken of centered() rows, so that they are as accurate far from the origin as near it.
    Returns (centers, each row's label and squared distance under them, rounds run).
    """
    k = len(centers)
    x, origin = centered(x, weights)
    centers = np.asarray(centers, dtype=np.float64) - origin
    x_sq = np.einsum("ij,ij->i", x, x)
    scale = float(weights @ x_sq / weights.sum()) or 1.0
    labels, sq_dist = nearest_with_norms(x, x_sq, centers)
    rounds = 0
    while rounds < max_iter:
        rounds += 1
        means, mass = weighted_means(x, weights, labels, k)
        moved = mass > 0
        shift = float(np.max(np.sum((means[moved] - centers[moved]) ** 2, axis=1), initial=0.0))
        centers[moved] = means[moved]
        new_labels, sq_dist = nearest_with_norms(x, x_sq, centers)
        unchanged = np.array_equal(new_labels, labels)
        labels = new_labels
        if unchanged or shift <= tol * scale:
            break
    return centers + origin, labels, sq_dist, rounds


def top_right_singular_vectors(x: np.ndarray, weights: np.ndarray, rank: int, rng: np.random.Generator) -> np.ndarray:
    """(rank, d) top right singular vectors of the weighted rows sqrt(w) * x.

    Below RANDOMIZED_SVD_MIN_DIM features they are the top eigenvectors of the (d, d) Gram matrix
    (a device is a tall, thin matrix: a quarter of an SVD's time at 500 x 32), or the SVD itself
    when the device has fewer rows than features.
    """
    a = x * np.sqrt(weights)[:, None]
    if x.shape[1] < RANDOMIZED_SVD_MIN_DIM:
        if len(a) < a.shape[1]:
            return np.linalg.svd(a, full_matrices=False)[2][:rank]
        vectors = np.linalg.eigh(a.T @ a)[1]  # eigenvalues in ascending order
        return vectors[:, ::-1][:, :rank].T
    # Randomized range finder (Halko, Martinsson and Tropp 2011) with two power iterations.
    sketch = a @ rng.standard_normal((x.shape[1], min(x.shape[1], rank + 10)))
    for _ in range(2):
        sketch = a @ (a.T @ np.linalg.qr(sketch)[0])
    basis = np.linalg.qr(sketch)[0]
    return np.linalg.svd(basis.T @ a, full_matrices=False)[2][:rank]


COST_TIE = 1e-9
"""Restarts whose costs differ by less than this fraction are ties: rounding must not pick the winner."""


def lowest_cost(costs: list[float]) -> int:
    """The first of the restarts whose cost is within COST_TIE of the lowest.

    Restarts that end in one clustering (in another order) have costs equal up to rounding, and
    rounding depends on where the origin is; the first of them wins, so a shifted or scaled table
    keeps the same ids.
    """
    lowest = min(costs)
    return next(i for i, cost in enumerate(costs) if cost <= lowest + COST_TIE * abs(lowest))


def between_sse(
    local_centers: np.ndarray, local_counts: np.ndarray, centers: np.ndarray, assignment: np.ndarray
) -> np.ndarray:
    """Each local center's count times its squared distance to its global center (centers[assignment]):
    with the local centers' own SSEs, the exact within-cluster SSE of the rows they stand for."""
    gap = np.asarray(local_centers, dtype=np.float64) - np.asarray(centers, dtype=np.float64)[assignment]
    return np.asarray(local_counts, dtype=np.float64) * np.einsum("ij,ij->i", gap, gap)


def too_few_distinct(k: int, distinct: int) -> ValueError:
    """The error of a server step asked for more clusters than there are distinct local centers."""
    return ValueError(
        f"k = {k} is more than the {distinct} distinct local centers the devices share; lower k, raise k_per_device "
        "or lower min_center_points"
    )
