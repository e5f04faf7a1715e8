"""PieceKey, the fallback searches' dict key for a demand piece: equal arrays are one key, different
arrays are different keys even when their fingerprints collide (equality compares the arrays)."""
from __future__ import annotations

import numpy as np

from lrmoe.planning.plan import PieceKey, fingerprint_kernel, split_piece


def test_equal_pieces_are_one_key_and_different_pieces_are_not():
    rng = np.random.default_rng(5)
    for G, E in ((1, 1), (2, 4), (8, 128), (64, 128), (3, 7)):
        d = rng.integers(0, 5000, (G, E))
        seen = {}
        for n in (1, 2, 3, 4, 7, 256):
            piece = split_piece(d, n)
            seen.setdefault(PieceKey(piece), []).append(n)
            again = PieceKey(piece.copy())
            assert again == PieceKey(piece) and hash(again) == hash(PieceKey(piece))
        # distinct pieces never share a key; identical ones (small counts split into ones) do
        for key, ns in seen.items():
            for n in ns:
                assert np.array_equal(split_piece(d, n), key.array)
        one = d.copy()
        one[rng.integers(G), rng.integers(E)] += 1
        assert PieceKey(one) != PieceKey(d)
        assert PieceKey(d.reshape(1, -1)) != PieceKey(d) or G == 1  # same values, other shape


def test_a_fingerprint_collision_does_not_merge_keys():
    a = np.array([[1, 2, 3]], dtype=np.int64)
    b = np.array([[3, 2, 1]], dtype=np.int64)
    ka, kb = PieceKey(a), PieceKey(b)
    kb.hash = ka.hash  # force the collision the weighted sum makes rarely
    assert ka != kb and len({ka: 0, kb: 1}) == 2
    assert fingerprint_kernel(a.reshape(-1)) != fingerprint_kernel(b.reshape(-1))
