from dynarec.features import DYNAMIC_KEY_BUCKETS, fingerprint64, to_hash_bucket_fast

GOLDEN = {  # TensorFlow 2.21: tf.strings.to_hash_bucket_fast(s, 2**62) and (s, 1000)
    "hello": (3786372426573024488, 296),
    "user_42": (2770529383709671217, 217),
    "": (1936946117179621455, 263),
    "中文": (1492797022198779051, 955),
}


def test_matches_tensorflow_to_hash_bucket_fast():
    strings = list(GOLDEN)
    assert to_hash_bucket_fast(strings, DYNAMIC_KEY_BUCKETS).tolist() == [v[0] for v in GOLDEN.values()]
    assert to_hash_bucket_fast(strings, 1000).tolist() == [v[1] for v in GOLDEN.values()]
    assert fingerprint64("hello") % 2**62 == 3786372426573024488
