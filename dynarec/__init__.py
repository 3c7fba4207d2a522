"""dynarec: recommendation models with fixed and dynamic sparse embeddings."""

from dynarec.embedding import (
    AdmissionConfig,
    DynamicTableOptions,
    EmbeddingCollection,
    FeatureConfig,
    Initializer,
    JaggedBatch,
    TableConfig,
)

__version__ = "0.1.0"

__all__ = [
    "AdmissionConfig",
    "DynamicTableOptions",
    "EmbeddingCollection",
    "FeatureConfig",
    "Initializer",
    "JaggedBatch",
    "TableConfig",
]
