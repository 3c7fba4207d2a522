"""Embedding tables (fixed and dynamic), their row stores and the collection.

Imports with torch alone: FBGEMM is imported only when a table asks for backend 'fbgemm'.
"""

from dynarec.embedding.collection import EmbeddingCollection
from dynarec.embedding.config import AdmissionConfig, DynamicTableOptions, FeatureConfig, TableConfig
from dynarec.embedding.dynamic import DynamicTable, TableFullError
from dynarec.embedding.initializers import Initializer
from dynarec.embedding.jagged import JaggedBatch
from dynarec.embedding.table import EmbeddingTable, FixedTable

__all__ = [
    "AdmissionConfig",
    "DynamicTable",
    "DynamicTableOptions",
    "EmbeddingCollection",
    "EmbeddingTable",
    "FeatureConfig",
    "FixedTable",
    "Initializer",
    "JaggedBatch",
    "TableConfig",
    "TableFullError",
]
