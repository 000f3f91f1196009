"""The held files of a tier digest: every set round-trips, in the shortest form; no value decodes beyond the table."""

from __future__ import annotations

import random

from overlapckpt.restore.held_files import ALL, BITMAP, INDICES, decode_held, encode_held


def test_every_held_set_round_trips():
    rng = random.Random(1)
    for case in range(400):
        files = rng.choice([0, 1, 2, 7, 8, 9, 127, 128, 129, rng.randrange(0, 3000)])
        density = rng.choice([0.0, 0.001, 0.01, 0.1, 0.5, 0.9, 0.999, 1.0])
        bits = sum(1 << i for i in range(files) if rng.random() < density)
        encoded = encode_held(bits, files)
        assert decode_held(encoded, files) == bits, (case, files, density)
        assert len(encoded) <= 1 + (files + 7) // 8  # never longer than a bitmap


def test_the_shortest_form_is_chosen():
    files = 8194
    assert encode_held((1 << files) - 1, files) == bytes([ALL])  # one node holds the whole checkpoint
    partner = sum(1 << i for i in (17, 18, 1040, 1041, 8192, 8193))  # its ranks' shards, a partner's, the head files
    encoded = encode_held(partner, files)
    assert encoded[0] == INDICES and len(encoded) <= 12
    half = sum(1 << i for i in range(0, files, 2))
    assert encode_held(half, files)[0] == BITMAP and len(encode_held(half, files)) == 1 + (files + 7) // 8
    assert encode_held(0, files) == bytes([INDICES])  # nothing held: one byte


def test_any_bytes_decode_to_files_of_the_table_only():
    rng = random.Random(0)
    for _ in range(2000):
        files = rng.randrange(0, 300)
        garbage = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
        assert decode_held(garbage, files) >> files == 0
    assert decode_held(bytes([INDICES]) + b"\xff" * 20, 100) == 0  # a number that never ends
    assert decode_held(bytes([INDICES, 5, 200]), 10) == 1 << 5  # an index past the table is not held
    assert decode_held(bytes([9, 1, 2]), 10) == 0  # an unknown form holds nothing
