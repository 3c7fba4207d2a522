"""Models by name (the key of the model block in the config)."""

from __future__ import annotations

from typing import Any

from torch import nn

from dynarec.config.schema import Config
from dynarec.models.deepfm import DeepFM
from dynarec.models.din import DIN
from dynarec.models.dlrm import DLRM
from dynarec.models.dlrm_hstu import DlrmHSTU
from dynarec.models.dssm import DAT, DSSM
from dynarec.models.hstu_match import HSTUMatch
from dynarec.models.mind import MIND
from dynarec.models.multi_task import DBMTL, PLE, MMoE, SimpleMultiTask
from dynarec.models.multi_tower_din import MultiTowerDIN
from dynarec.models.pepnet import PEPNet
from dynarec.models.rankers import DCN, DCNV2, MaskNet, WuKong, XDeepFM
from dynarec.models.rocket_launching import RocketLaunching
from dynarec.models.sid import SidRqkmeans, SidRqvae
from dynarec.models.tdm import TDM
from dynarec.models.wide_and_deep import WideAndDeep

__all__ = ["MODELS", "build_model"]

MODELS: dict[str, Any] = {  # model key -> class taking (config, its own model block)
    "multi_tower_din": MultiTowerDIN,
    "din": DIN,
    "deepfm": DeepFM,
    "wide_and_deep": WideAndDeep,
    "dlrm": DLRM,
    "dcn": DCN,
    "dcn_v2": DCNV2,
    "xdeepfm": XDeepFM,
    "mask_net": MaskNet,
    "wukong": WuKong,
    "rocket_launching": RocketLaunching,
    "simple_multi_task": SimpleMultiTask,
    "mmoe": MMoE,
    "ple": PLE,
    "dbmtl": DBMTL,
    "pepnet": PEPNet,
    "dssm": DSSM,
    "dat": DAT,
    "mind": MIND,
    "dlrm_hstu": DlrmHSTU,
    "ultra_hstu": DlrmHSTU,  # several channels: its config's hstu is a list
    "hstu_match": HSTUMatch,
    "sid_rqvae": SidRqvae,
    "sid_rqkmeans": SidRqkmeans,
    "tdm": TDM,
}


def build_model(config: Config) -> nn.Module:
    """The dense part of the model: ``(embeddings, seq_lengths, dense) -> logits``, ``[B]`` for a
    single-task model, ``[B, K]`` for a multi-task one (dynarec.models.tasks)."""
    name = config.model.name
    return MODELS[name](config, getattr(config.model, name))
