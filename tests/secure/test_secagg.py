"""Secure aggregation's protocol (retexo_fl.secure.secagg) from first principles: what the server
sees of one reply, the decoded sum's error, dropouts, the threshold, and bad input."""

from __future__ import annotations

import itertools
import types

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from retexo_fl.secure import secagg, shamir
from retexo_fl.secure.keys import public_bytes
from retexo_fl.secure.masking import pairwise_mask_seed
from retexo_fl.secure.secagg import (
    METRIC_NAMES,
    SecAggError,
    UnmaskLedger,
    UpdateGrid,
    VectorCodec,
    answer_unmask,
    decode_answer,
    encode_answer,
    expand_rows,
    mask_vector,
    share_seed,
    unmask_round,
)
from retexo_fl.secure.settings import min_threshold

TRANSCRIPT = bytes(range(32))


@pytest.fixture(autouse=True)
def seeded_urandom(monkeypatch):
    """Self seeds from a fixed generator, so every statistic below is the same on every run."""
    gen = np.random.default_rng(1234)
    monkeypatch.setattr(secagg, "os", types.SimpleNamespace(urandom=lambda n: gen.bytes(n)))


class Party:
    """One client of a round, driven through the protocol functions the handlers use."""

    def __init__(self, pid: int, key: X25519PrivateKey) -> None:
        self.id, self.key = pid, key
        self.public = public_bytes(key)

    def pair_seeds(
        self, publics: dict[int, bytes], others: list[int], stage: int, round_: int, terms: bytes = b""
    ) -> dict:
        return {
            q: pairwise_mask_seed(self.key, publics[q], TRANSCRIPT, self.id, q, stage, round_, terms)
            for q in others
        }


def _parties(n: int) -> tuple[list[Party], dict[int, bytes]]:
    gen = np.random.default_rng(7)
    parties = [Party(i, X25519PrivateKey.from_private_bytes(gen.bytes(32))) for i in range(n)]
    return parties, {p.id: p.public for p in parties}


def _metrics(i: int) -> dict[str, float]:
    return {
        "weight": 0.1 * (i + 1),
        "weighted_loss": 0.1 * (i + 1) * 1.5,
        "val_correct": 10 + i,
        "val_count": 30 + i,
        "val_loss": 20.0 + i,
        "dp_clipped": 0.0,
    }


def _run_round(
    n, updates, threshold=None, dropped=(), stage=1, round_=3, answering=None, terms=None, codec=None
):
    """Every party masks (party ``i`` under the round terms ``terms[i]``, default none); the
    server gets the survivors' vectors and their unmask answers."""
    terms = terms or {}
    parties, publics = _parties(n)
    members = list(range(n))
    threshold = threshold or min_threshold(n)
    codec = codec or VectorCodec(updates.shape[1], n, update_clip=1.0, weight_bound=100.0)
    own, held, packed = {}, {i: {} for i in members}, {}
    for p in parties:
        seed, shares = share_seed(p.id, members, threshold)
        for h, s in shares.items():
            held[h][p.id] = s
        pair = p.pair_seeds(publics, [q for q in members if q != p.id], stage, round_, terms.get(p.id, b""))
        rng = np.random.default_rng(p.id)
        packed[p.id], _, _ = mask_vector(
            codec, updates[p.id], _metrics(p.id), p.id, seed, pair, stage, round_, rng
        )
        own[p.id] = seed
    survivors = [i for i in members if i not in dropped]
    vectors = {i: codec.unpack(packed[i], stage, round_, f"client {i}") for i in survivors}
    answers = {}
    for p in parties:
        if p.id not in survivors or (answering is not None and p.id not in answering):
            continue
        drop = [d for d in members if d not in survivors]
        pair = p.pair_seeds(publics, drop, stage, round_, terms.get(p.id, b""))
        shares = {j: held[p.id][j] for j in survivors}
        answers[p.id] = answer_unmask(p.id, members, survivors, threshold, shares, pair, f"client {p.id}")
    return codec, packed, vectors, answers, members, threshold, own


def test_a_masked_reply_is_uniform_and_uncorrelated_with_its_update():
    """The server's view of one reply: its field elements pass a chi-square test for uniformity
    (fixed seed), and none equals or correlates with the client's unmasked encoding or update."""
    n, size = 4, 40_000
    # A structured update: a ramp and a constant block, nothing like uniform noise.
    update = np.concatenate([np.linspace(-0.5, 0.5, size // 2), np.full(size // 2, 0.25)])
    updates = np.stack([update * (i + 1) / n for i in range(n)])
    codec, _, vectors, *_ = _run_round(n, updates)
    plain, _ = codec.encode(updates[0], _metrics(0), np.random.default_rng(0))
    masked = vectors[0]
    # Uniformity: the top 8 bits of every element in 256 bins; 255 degrees of freedom, the
    # 0.999 quantile of chi-square(255) is 330.5.
    counts = np.bincount((masked >> 24).astype(np.int64), minlength=256)
    expected = masked.size / 256
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 330.5, chi2
    # ... and the low 8 bits too (a mask that left low bits alone would show here).
    low = np.bincount((masked & 0xFF).astype(np.int64), minlength=256)
    assert float(((low - expected) ** 2 / expected).sum()) < 330.5
    # Structure: every coordinate of the unmasked encoding sits in [0, 2K], a 32nd of the field;
    # the masked one lands there as often as uniform values do (binomial, within 5 deviations),
    # and no coordinate equals the plain one beyond chance (expected 40,008 / 2**32).
    assert np.count_nonzero(masked == plain) == 0
    p = (2 * codec.update_fp.offset + 1) / 2**32
    assert np.all(plain[: codec.size] <= 2 * codec.update_fp.offset)
    inside = np.count_nonzero(masked[: codec.size] <= 2 * codec.update_fp.offset)
    assert abs(inside - codec.size * p) < 5 * np.sqrt(codec.size * p * (1 - p)), inside
    for reference in (plain.astype(np.float64), np.concatenate([update, np.zeros(len(METRIC_NAMES))])):
        r = np.corrcoef(masked.astype(np.float64), reference)[0, 1]
        assert abs(r) < 4 / np.sqrt(masked.size), r  # four standard errors of a zero correlation
    # The same client's vectors of two rounds are unrelated too (fresh self seed, new pair seeds).
    _, _, again, *_ = _run_round(n, updates, round_=4)
    r = np.corrcoef(masked.astype(np.float64), again[0].astype(np.float64))[0, 1]
    assert abs(r) < 4 / np.sqrt(masked.size)


def test_the_decoded_sum_equals_the_plain_sum_within_the_fixed_point_error():
    n, size = 5, 3_000
    gen = np.random.default_rng(3)
    updates = gen.uniform(-0.9, 0.9, (n, size))
    codec, _, vectors, answers, members, t, _ = _run_round(n, updates)
    (total, metrics, _), count = unmask_round(codec, vectors, members, t, answers)
    assert count == n
    error = codec.sum_error(n)  # n * 2**-scale_bits, a strict bound from stochastic rounding
    assert 0 < error < 1e-5
    assert np.max(np.abs(total - updates.sum(0))) < error
    assert metrics["val_correct"] == sum(10 + i for i in range(n))
    assert metrics["val_count"] == sum(30 + i for i in range(n))
    assert metrics["weight"] == pytest.approx(sum(0.1 * (i + 1) for i in range(n)), abs=1e-5)


def test_a_client_lost_after_masking_leaves_the_survivors_sum_exact():
    n, size = 5, 2_000
    updates = np.random.default_rng(4).uniform(-0.5, 0.5, (n, size))
    codec, _, vectors, answers, members, t, _ = _run_round(n, updates, dropped=(2,))
    (total, metrics, _), count = unmask_round(codec, vectors, members, t, answers)
    survivors = [0, 1, 3, 4]
    assert count == 4 and metrics["val_count"] == sum(30 + i for i in survivors)
    assert np.max(np.abs(total - updates[survivors].sum(0))) < codec.sum_error(4)


def test_fewer_than_the_threshold_never_decodes():
    n = 5  # threshold 4
    updates = np.random.default_rng(5).uniform(-0.5, 0.5, (n, 500))
    codec, _, vectors, answers, members, t, _ = _run_round(n, updates, dropped=(1,), answering=[0, 2, 3])
    assert t == 4 and len(answers) == 3
    with pytest.raises(SecAggError, match="fewer than the threshold 4"):
        unmask_round(codec, vectors, members, t, answers)
    # Two dropped: the survivors refuse to unmask at all, and the server cannot either.
    with pytest.raises(SecAggError, match="fewer than the threshold"):
        answer_unmask(0, members, [0, 3, 4], t, {0: b"", 3: b"", 4: b""}, {}, "client 0")
    # Enough answers, but a survivor that did not answer holds a pair seed with the dropped one.
    codec, _, vectors, answers, members, t, _ = _run_round(n, updates, dropped=(1,), answering=[0, 2, 3, 4])
    del answers[4]
    answers[0] = answers[0]  # still 3 answers of 4 survivors: below t, refused before anything else
    with pytest.raises(SecAggError, match="fewer than the threshold"):
        unmask_round(codec, vectors, members, t, answers)


def test_a_survivor_missing_from_the_unmasking_blocks_a_round_with_a_dropout():
    n = 7  # threshold 5: 6 survivors, 5 of them answer
    updates = np.random.default_rng(6).uniform(-0.5, 0.5, (n, 300))
    codec, _, vectors, answers, members, t, _ = _run_round(
        n, updates, dropped=(6,), answering=[0, 1, 2, 3, 4]
    )
    with pytest.raises(SecAggError, match="client 5 gave no pair seed"):
        unmask_round(codec, vectors, members, t, answers)
    # Without a dropout, any t answers decode the round.
    codec, _, vectors, answers, members, t, _ = _run_round(n, updates, answering=[0, 1, 2, 3, 4])
    (total, _, _), _ = unmask_round(codec, vectors, members, t, answers)
    assert np.max(np.abs(total - updates.sum(0))) < codec.sum_error(n)


def test_bad_input_is_refused_naming_the_client():
    n = 4
    updates = np.random.default_rng(8).uniform(-0.5, 0.5, (n, 200))
    codec, packed, vectors, answers, members, t, _ = _run_round(n, updates)
    # A mask for the wrong round, a cut vector, a vector of 64-bit elements, no vector at all.
    with pytest.raises(
        SecAggError, match="client 2: a masked vector for stage 1 round 3, expected stage 1 round 4"
    ):
        codec.unpack(packed[2], 1, 4, "client 2")
    with pytest.raises(SecAggError, match="client 2: a masked vector of"):
        codec.unpack(packed[2][:-4], 1, 3, "client 2")
    wide = packed[2][:25] + np.frombuffer(packed[2][25:], "<u4").astype("<u8").tobytes()
    with pytest.raises(SecAggError, match="client 2: a masked vector of"):
        codec.unpack(wide, 1, 3, "client 2")
    with pytest.raises(SecAggError, match="client 1: not a masked vector"):
        codec.unpack(b"\0" * 64, 1, 3, "client 1")
    # A malformed share or seed in an unmask answer.
    good = encode_answer(*answers[1])
    for key, value, why in (
        ("share-0", b"\1" * 5, "a share of 5 bytes"),
        ("seed-0", b"\1" * 31, "a seed of 31 bytes"),
        ("junk-0", b"\1", "malformed unmask answer entry"),
    ):
        with pytest.raises(SecAggError, match=f"client 1: {why}"):
            decode_answer({**good, key: value}, "client 1")
    # A share out of the field's range: refused naming its holder.
    broken = {h: dict(a[0]) for h, a in answers.items()}
    broken[1][0] = (shamir.PRIME + 5).to_bytes(shamir.SHARE_BYTES, "big")
    bad = {h: (broken[h], answers[h][1]) for h in answers}
    with pytest.raises(SecAggError, match="holder 1: share value is not below the field's prime"):
        unmask_round(codec, vectors, members, t, bad)
    # A wrong but well-formed share among more than t: the two subsets disagree.
    altered = bytearray(answers[3][0][0])
    altered[-1] ^= 1
    bad = {
        h: ({**answers[h][0], 0: bytes(altered)} if h == 3 else answers[h][0], answers[h][1]) for h in answers
    }
    with pytest.raises(SecAggError, match="client 0's self seed from holders \\[0, 1, 2, 3\\] disagree"):
        unmask_round(codec, vectors, members, t, bad)


def test_a_sum_unmasked_with_a_wrong_seed_does_not_decode():
    """Exactly t shares, one of them wrong: the rebuilt self seed is wrong, the unmasked sum is
    uniform noise, and the range check refuses it instead of producing a model."""
    n = 4
    updates = np.random.default_rng(9).uniform(-0.5, 0.5, (n, 400))
    codec, _, vectors, answers, members, t, _ = _run_round(n, updates, answering=[0, 1, 2])
    altered = bytearray(answers[1][0][2])
    altered[-1] ^= 1
    answers[1] = ({**answers[1][0], 2: bytes(altered)}, answers[1][1])
    with pytest.raises(SecAggError, match="does not decode"):
        unmask_round(codec, vectors, members, t, answers)


def test_thresholds_and_survivor_sets_that_would_unmask_a_client_are_refused():
    members = list(range(4))
    with pytest.raises(SecAggError, match="client 0: secure aggregation threshold 2 for 4 clients"):
        share_seed(0, members, 2)
    with pytest.raises(SecAggError, match="does not hold this client"):
        share_seed(9, members, 3)
    with pytest.raises(SecAggError, match="not a subset"):
        answer_unmask(0, members, [0, 1, 5], 3, {}, {}, "client 0")
    ledger = UnmaskLedger()
    ledger.check(1, 3, [0, 1, 2], "d1", "client 0")
    ledger.check(1, 3, [2, 1, 0], "d1", "client 0")  # the same story again (a resumed server): answered
    with pytest.raises(SecAggError, match="refusing a second story"):
        ledger.check(1, 3, [0, 1, 3], "d1", "client 0")
    with pytest.raises(SecAggError, match="and other shares; refusing a second story"):
        ledger.check(1, 3, [0, 1, 2], "d2", "client 0")  # the same survivors, other shares
    ledger.check(1, 4, [0, 1, 3], "d2", "client 0")  # another round is another story


def _unmasks(n: int, t: int, v: int, views: dict[int, list[int]]) -> bool:
    """Whether a server that told each client ``w`` the survivor set ``views[w]`` learns client
    ``v``'s self seed (``t`` shares) and every pair seed of ``v``, from honest answers."""
    members = list(range(n))
    shares, pairs = 0, set()
    for w in members:
        try:
            got_shares, got_seeds = answer_unmask(
                w, members, views[w], t, {j: b"s" for j in views[w]}, {d: b"p" for d in members}, ""
            )
        except SecAggError:
            continue
        shares += v in got_shares
        if w == v:
            pairs |= set(got_seeds)
        elif v in got_seeds:
            pairs.add(w)
    return shares >= t and pairs == set(members) - {v}


@pytest.mark.parametrize("n", [4, 5])
def test_no_story_told_to_honest_clients_unmasks_one_at_the_threshold(n):
    """Every assignment of survivor sets (each client's own view, at least t of the members with
    itself among them): at the threshold the clients require, none gets a client's self seed and
    all its pair seeds; one below it, some does, so the bound is what protects."""
    v = 0

    def views(t):
        sets = [
            [list(c) for k in range(t, n + 1) for c in itertools.combinations(range(n), k) if w in c]
            for w in range(n)
        ]
        return itertools.product(*sets)

    t = min_threshold(n)
    assert not any(_unmasks(n, t, v, dict(enumerate(vs))) for vs in views(t))
    assert any(_unmasks(n, t - 1, v, dict(enumerate(vs))) for vs in views(t - 1))


def test_counts_sum_exactly_at_scale():
    """Validation counts are integers in a segment of their own: 200 clients of up to 500,000
    nodes sum them exactly (as fractions of the node bound, an attack review found every round's
    count decoded wrong at this size)."""
    members, bound = 200, 500_000.0
    codec = VectorCodec(16, members, update_clip=10.0, weight_bound=bound)
    gen = np.random.default_rng(11)
    total, want = np.zeros(codec.length, dtype=np.uint32), {"val_correct": 0, "val_count": 0}
    for i in range(members):
        count = int(gen.integers(0, 500_000))
        correct = int(gen.integers(0, count + 1))
        metrics = {**_metrics(i), "weight": 1 / members, "val_correct": correct, "val_count": count}
        vector, _ = codec.encode(gen.uniform(-1, 1, 16), metrics, np.random.default_rng(i))
        total += vector
        want["val_correct"] += correct
        want["val_count"] += count
    _, metrics, _ = codec.decode(total, members)
    assert metrics["val_correct"] == want["val_correct"] and metrics["val_count"] == want["val_count"]
    assert metrics["weight"] == pytest.approx(1.0, abs=members * 2.0**-codec.metric_fp.scale_bits)


def test_clients_sent_different_round_terms_unmask_to_nothing():
    """The pair masks bind the round's terms (member set, threshold, weight bound): a server
    that sends one client other terms than the rest gets a sum whose pair masks do not cancel,
    which does not decode; the same terms for all decode exactly as without terms."""
    n, size = 4, 2_000
    updates = np.stack([np.full(size, 0.01 * (i + 1)) for i in range(n)])
    same = {i: b"A" * 32 for i in range(n)}
    codec, _, vectors, answers, members, threshold, _ = _run_round(n, updates, terms=same)
    (total, _, _), count = unmask_round(codec, vectors, members, threshold, answers)
    assert count == n and np.max(np.abs(total - updates.sum(0))) < codec.sum_error(n)
    split = {**same, 0: b"B" * 32}  # client 0 alone was sent other terms
    codec, _, vectors, answers, members, threshold, _ = _run_round(n, updates, terms=split)
    with pytest.raises(SecAggError, match="does not decode"):
        unmask_round(codec, vectors, members, threshold, answers)


def test_compressed_updates_unmask_from_their_narrow_lanes_to_the_exact_code_sum():
    """4-bit codes on a shared grid: 6 bits a coordinate travel (a sum of 4 codes is at most 56),
    a survivor's lanes look uniform, and the survivors' sum is exactly the sum of their codes,
    with a dropped member's masks removed as in full width."""
    n, rows = 4, (100, 100, 100)
    row_clips = np.array([0.5, 0.1, 0.02])
    grid = UpdateGrid(expand_rows(row_clips, list(rows)), bits=4, members=n)
    assert (grid.levels, grid.lane_bits) == (7, 6)
    codec = VectorCodec(sum(rows), n, update_clip=1.0, weight_bound=100.0, grid=grid, row_sizes=rows)
    updates = np.random.default_rng(3).uniform(-1.2, 1.2, (n, sum(rows))) * grid.clips  # some clipped
    _, packed, vectors, answers, members, t, _ = _run_round(n, updates, dropped=(2,), codec=codec)
    header, metrics = 25, 4 * (len(rows) + len(METRIC_NAMES))
    assert all(len(b) == header + (300 * 6 + 7) // 8 + metrics for b in packed.values())
    assert int(np.count_nonzero(vectors[0][:300] <= 2 * grid.levels)) < 120  # codes alone: all 300
    (total, metrics_sum, peaks), count = unmask_round(codec, vectors, members, t, answers)
    survivors = [0, 1, 3]
    codes = [codec.encode(updates[i], _metrics(i), np.random.default_rng(i))[0][:300] for i in survivors]
    assert count == 3
    np.testing.assert_allclose(total, sum(grid.dequantize(c) for c in codes), rtol=0, atol=1e-12)
    sent = sum(np.clip(updates[i], -grid.clips, grid.clips) for i in survivors)
    assert np.abs(total - sent).max() <= count * grid.clips.max() / grid.levels
    want = sum(np.abs(updates[i]).reshape(3, 100).max(axis=1) for i in survivors)
    np.testing.assert_allclose(peaks, want, atol=codec.update_fp.sum_error(3))
    assert metrics_sum["val_count"] == sum(30 + i for i in survivors)
    with pytest.raises(SecAggError, match=r"6 bits declared\), expected 311 values, the update's in 32-bit"):
        VectorCodec(300, n, 1.0, 100.0, row_sizes=rows).unpack(packed[0], 1, 3, "client 0")  # not its grid


def test_a_grid_whose_sums_would_not_fit_a_field_element_is_refused():
    with pytest.raises(SecAggError, match="needs 33 bits"):
        UpdateGrid(np.ones(4), bits=16, members=70_000)
