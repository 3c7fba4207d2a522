import pytest

from dynarec.features import DYNAMIC_KEY_BUCKETS, fingerprint64, native, to_hash_bucket_fast
from dynarec.features.hashing import hash_buckets, hash_buckets_reference, murmur2_64

GOLDEN = {  # TensorFlow 2.21: tf.strings.to_hash_bucket_fast(s, 2**62) and (s, 1000)
    "hello": (3786372426573024488, 296),
    "user_42": (2770529383709671217, 217),
    "": (1936946117179621455, 263),
    "中文": (1492797022198779051, 955),
}

# TorchEasyRec's default hash: libstdc++'s std::hash<std::string> (64-bit MurmurHash2, seed
# 0xc70f6907), mod 100 as in its unit tests (docs/tzrec_features_spec.md §1.4: id_feature_test,
# combo_feature_test, lookup_feature_test), and the full hashes of g++'s std::hash (GCC 12, x86-64).
MURMUR2_MOD_100 = {
    "abc": 33, "efg": 44, "hij": 66, "xyz": 13, "1": 95, "2": 70, "3": 13, "4": 56, "0": 26,
    "ua_ia": 37, "uh_if": 55, "ua_abc": 2, "ua_efg": 42, "ua_hij": 3, "ub_hij": 23, "x": 35, "y": 30, "z": 54,
}  # fmt: skip
MURMUR2_FULL = {
    "abc": 3663726644998027833,
    "1": 10159970873491820195,
    "": 6142509188972423790,
    "hello world, longer string 12345": 8966869353514864352,  # 32 bytes: four words, no tail
    "中文": 9854956157463167294,
}
# With USE_FARM_HASH_TO_BUCKETIZE TorchEasyRec hashes with Fingerprint64 (id_feature_test.py:274).
FARMHASH_MOD_100 = {"1": 49, "2": 59, "3": 21}


def test_matches_tensorflow_to_hash_bucket_fast():
    strings = list(GOLDEN)
    assert to_hash_bucket_fast(strings, DYNAMIC_KEY_BUCKETS).tolist() == [v[0] for v in GOLDEN.values()]
    assert to_hash_bucket_fast(strings, 1000).tolist() == [v[1] for v in GOLDEN.values()]
    assert fingerprint64("hello") % 2**62 == 3786372426573024488


def test_murmur2_is_libstdcxx_std_hash_and_torcheasyrecs_buckets():
    assert {s: murmur2_64(s) for s in MURMUR2_FULL} == MURMUR2_FULL
    assert {s: murmur2_64(s) % 100 for s in MURMUR2_MOD_100} == MURMUR2_MOD_100
    assert hash_buckets(list(MURMUR2_MOD_100), 100, "murmur2").tolist() == list(MURMUR2_MOD_100.values())
    assert hash_buckets(list(FARMHASH_MOD_100), 100).tolist() == list(FARMHASH_MOD_100.values())


@pytest.mark.parametrize("function", ["farmhash", "murmur2"])
def test_the_python_path_gives_the_same_buckets(function):
    strings = [*MURMUR2_MOD_100, *MURMUR2_FULL, "abc"]
    with native.python_path():
        slow = hash_buckets(strings, 1000, function)
    assert slow.tolist() == hash_buckets(strings, 1000, function).tolist()
    assert slow.tolist() == hash_buckets_reference(strings, 1000, function).tolist()
