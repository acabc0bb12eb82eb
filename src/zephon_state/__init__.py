"""zephon_state: a training-time data pipeline whose global batch does not depend on the number of ranks.

Dependencies point one way: zephon_state -> torch, numpy, orjson, fsspec, tokenizers. It knows
nothing of checkpoint files; it hands the checkpointer plain state (``Pipeline.state_dict``).
"""
import importlib.metadata

__version__ = importlib.metadata.version("flexckpt")  # the distribution's, from pyproject.toml

from .batch import Batch, block_causal_mask
from .config import BatchConfig, DataParallel, Options, PackConfig, ShuffleConfig, TokenizeConfig
from .cursor import LaneCursor, SourceState
from .digest import global_batch_digest, lane_digest
from .errors import (
    BadRecordError,
    ConfigError,
    FingerprintMismatch,
    SourceError,
    StateError,
    TokenizerNotFound,
    ZephonError,
)
from .holdout import HoldoutConfig
from .pack import IGNORE, PAD_DOCUMENT
from .pipeline import Pipeline, PipelineConfig
from .mixture import Mix
from .source import InMemory, JsonLines, Source, SourceReport, TextFiles
from .storage import CacheOptions, IoOptions
from .tokenize import load_tokenizer
from .topology import Topology

__all__ = [
    "__version__",
    "BadRecordError", "Batch", "BatchConfig", "CacheOptions", "ConfigError", "DataParallel",
    "FingerprintMismatch", "HoldoutConfig", "IGNORE", "InMemory", "IoOptions", "JsonLines",
    "LaneCursor", "Mix", "Options", "PAD_DOCUMENT", "PackConfig", "Pipeline", "PipelineConfig", "SourceState",
    "ShuffleConfig", "Source", "SourceError", "SourceReport", "StateError", "TextFiles", "TokenizeConfig",
    "TokenizerNotFound", "Topology", "ZephonError", "block_causal_mask", "global_batch_digest",
    "lane_digest", "load_tokenizer",
]
