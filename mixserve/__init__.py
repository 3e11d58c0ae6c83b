"""mixserve: cheap serving of frontier MoE models in JAX (FP8 KV cache, INT4 weights, KV integrity tags)."""

from mixserve.disaggregated import DisaggregatedEngine
from mixserve.engine import Engine, Result, TokenLogprobs, Update
from mixserve.grammar import StructuredOutput
from mixserve.model import Model, count_params, load
from mixserve.weight_bytes import weight_bytes

__all__ = ["DisaggregatedEngine", "Engine", "Model", "Result", "StructuredOutput", "TokenLogprobs", "Update", "count_params",
           "load", "weight_bytes"]
