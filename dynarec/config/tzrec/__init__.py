"""``dynarec import-config``: a TorchEasyRec ``pipeline.config`` as a dynarec YAML config.

Every field of the input is either carried (same name and meaning), mapped (to a named dynarec
setting; the note says how), ignored with a printed note (settings with no effect on what is
trained: ODPS connection details once the data source is replaced, thread counts, tensorboard
switches), or refused: an error naming its path (``model_config.multi_tower_din.towers[1].mlp.
use_bn: not supported``). Nothing is dropped silently; ``lenient=True`` turns refusals into a
list of dropped fields. docs/import_config.md has the table of every field.

The semantics are TorchEasyRec's (``tzrec/protos``, ``tzrec/features``, ``tzrec/models``):

- ``fg_mode: FG_NONE``: the input holds encoded ids: a feature reads the column named after
  it, ``hash_bucket_size`` and ``boundaries`` tables take their ids as they are, normalizers
  do not apply. ``FG_DAG`` / ``FG_NORMAL``: a feature reads its ``expression``'s column and
  dynarec does the feature generation (hashing, bucketizing, normalizing).
- Sub-features of a ``sequence_feature`` are named ``<sequence_name>__<feature_name>`` and
  read the column ``<sequence_name>__<input_name>`` (``FG_NONE``: ``__<feature_name>``).
- Features of a ``WIDE`` group get their own tables (``<table>_wide``) of
  ``wide_embedding_dim`` (default 4), as TorchEasyRec builds them.
"""

from dynarec.config.tzrec.convert import ConversionError, ConversionResult, convert_pipeline_config

__all__ = ["ConversionError", "ConversionResult", "convert_pipeline_config"]
