"""Feature hashing and specs shared by the data and model layers."""

from dynarec.features.hashing import DYNAMIC_KEY_BUCKETS, fingerprint64, to_hash_bucket_fast

__all__ = ["DYNAMIC_KEY_BUCKETS", "fingerprint64", "to_hash_bucket_fast"]
