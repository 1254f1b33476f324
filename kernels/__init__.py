"""Triton kernels for the training and rollout hot paths, each with a plain torch reference
(``agentrl.kernels.reference``) and a fallback where Triton cannot run. No ``__version__`` here
on purpose: transformers probes a top-level ``kernels`` package for one.

- ``fused_logprob_entropy``: per-token log-prob and entropy from hidden states and the LM head
  without the full logits (Triton on CUDA, chunked torch elsewhere).
- ``fused_policy_loss``: the clipped policy loss of the GRPO/PPO family with KL, entropy, TIS,
  masking and aggregation, and its gradient, in one pass (Triton only; the torch path is
  ``agentrl.trainer.policy_loss``).
- ``paged_decode_attention``: one decode step of attention over the embedded engine's paged KV
  cache, grouped-query heads in one program.
- ``paged_prefill_attention``: a step's prefill chunks (new tokens after a cached context),
  causal over the same paged cache, every chunk in one launch.
- ``_fused_ops``: the embedded engine's per-layer elementwise work (RMSNorm with its residual
  add, rotary embedding, SiLU·mul), one kernel each.

This folder is also a top-level ``kernels`` when a checkout's root is on ``sys.path`` ahead of
site-packages (``python -m ...`` run from it), where it would hide the ``kernels`` distribution
that transformers imports; under that name it loads the distribution in its own place
(``_distribution_in_place``) once it has run.
"""

from . import reference as reference
from ._logprob import FusedLogprobEntropy as FusedLogprobEntropy
from ._logprob import fused_logprob_entropy as fused_logprob_entropy
from ._logprob_gemm import GemmLogprobEntropy as GemmLogprobEntropy
from ._paged_attention import paged_decode_attention as paged_decode_attention
from ._paged_attention import paged_prefill_attention as paged_prefill_attention
from ._policy_loss import K3_MAX as K3_MAX
from ._policy_loss import MAX_LOG_RATIO as MAX_LOG_RATIO
from ._policy_loss import PolicyLossStats as PolicyLossStats
from ._policy_loss import fused_policy_loss as fused_policy_loss
from ._policy_loss import sequence_segments as sequence_segments
from ._triton import BACKENDS as BACKENDS
from ._triton import interpreting as interpreting
from ._triton import triton_available as triton_available
from ._triton import triton_installed as triton_installed
from ._triton import use_triton as use_triton

__all__ = [
    "BACKENDS",
    "FusedLogprobEntropy",
    "GemmLogprobEntropy",
    "K3_MAX",
    "MAX_LOG_RATIO",
    "PolicyLossStats",
    "fused_logprob_entropy",
    "fused_policy_loss",
    "interpreting",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reference",
    "sequence_segments",
    "triton_available",
    "triton_installed",
    "use_triton",
]


def _distribution_in_place() -> bool:
    """Imported as the top-level ``kernels``: find that name on ``sys.path`` outside this
    checkout and execute it as ``sys.modules["kernels"]``, which is what the import statement
    then returns (it reads the entry back after this module ran). False when no other
    ``kernels`` is installed: this package then stands in."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        return False
    ours = sys.modules["kernels"]
    for name in [n for n in sys.modules if n.startswith("kernels.")]:
        del sys.modules[name]  # this folder's modules, loaded above under the borrowed name
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules["kernels"] = ours
        raise
    return True


if __name__ == "kernels":  # a checkout's root ahead of site-packages (see above)
    _distribution_in_place()
