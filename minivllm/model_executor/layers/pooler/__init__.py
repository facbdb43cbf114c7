"""Poolers: hidden states of whole prompts -> one output per sequence (seqwise.py) or per token
(tokwise.py); `DispatchPooler` holds one per task (special.py). vLLM's package layout."""

from minivllm.model_executor.layers.pooler.abstract import Pooler
from minivllm.model_executor.layers.pooler.common import (ClassifierFn, PoolingParamsUpdate,
                                                          PoolingType, ProjectorFn)
from minivllm.model_executor.layers.pooler.special import (BgeM3Pooler, BOSEOSFilter,
                                                           DispatchPooler, IdentityPooler)

__all__ = ["BgeM3Pooler", "BOSEOSFilter", "ClassifierFn", "DispatchPooler", "IdentityPooler",
           "Pooler", "PoolingParamsUpdate", "PoolingType", "ProjectorFn"]
