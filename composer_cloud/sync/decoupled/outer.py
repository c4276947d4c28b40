"""The arithmetic of a decoupled merge: token weights and the one outer step, pure CPU functions.

A global version's state is ``{FRAGMENT_KEY: {ORIGINAL_PARAMETERS, OUTER_OPTIMIZER}}``
(torchft's layout of one DiLoCo fragment, its keys from :mod:`composer_cloud.sync.state_tree`, so ``export``
and the lock-step readers load it unchanged). Version ``v`` = version ``v-1`` after one outer
step (:func:`outer_step`) on the weighted sum of the merged pseudo-gradients.
Equal inputs give equal bytes in every process: the weights are float64
(exact in JSON), the sum runs in float32 in record order, and the step is
``torch.optim.SGD`` with the spec's hyper-parameters (the stored ones are
ignored: the bucket is untrusted).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from composer_cloud.storage.records import Contribution
from composer_cloud.sync.outer import OuterOptimizerConfig, outer_sgd
from composer_cloud.sync.state_tree import ORIGINAL_PARAMETERS, OUTER_OPTIMIZER, fragment_key

if TYPE_CHECKING:
    import torch

#: torchft's state-dict key of fragment 0: ``export`` and ``load_global_parameters`` read it.
FRAGMENT_KEY = fragment_key(0)


def token_weights(contributions: Sequence[Contribution], replicas: int) -> list[float]:
    """The weights of a merge: ``tokens_i / sum(tokens) * k / replicas`` for its ``k`` contributions.

    Within a merge, contributions count by tokens. The merge as a whole counts
    as the fraction ``k / replicas`` of a fleet round: a merge of all replicas'
    contributions is lock-step's average (weights sum to 1), and two merges of
    half the fleet each move the global as far as one full round would, rather
    than each taking a full outer step (which, with Nesterov momentum, doubles
    the effective outer learning rate and overshoots).
    """
    total = sum(c.tokens for c in contributions)
    share = len(contributions) / replicas
    return [c.tokens / total * share for c in contributions]


def initial_state(params: Mapping[str, torch.Tensor], outer: OuterOptimizerConfig) -> dict[str, Any]:
    """Version 0's state tree: the parameters and a fresh (empty) outer optimizer state."""
    import torch

    plist = [torch.nn.Parameter(p.detach().to("cpu").clone()) for p in params.values()]
    return {FRAGMENT_KEY: {ORIGINAL_PARAMETERS: {n: p.detach().to("cpu").clone() for n, p in params.items()},
                           OUTER_OPTIMIZER: outer_sgd(plist, outer).state_dict()}}


def outer_step(state: Mapping[str, Any], deltas: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float],
               outer: OuterOptimizerConfig) -> dict[str, Any]:
    """Global ``v-1`` -> ``v``: one SGD step with grad = sum_i w_i * delta_i. With no deltas the state is
    returned unchanged (no step: momentum must not move on nothing)."""
    import torch

    frag = state[FRAGMENT_KEY]
    names = list(frag[ORIGINAL_PARAMETERS])
    if not deltas:
        return {FRAGMENT_KEY: {ORIGINAL_PARAMETERS: {n: frag[ORIGINAL_PARAMETERS][n].clone() for n in names},
                               OUTER_OPTIMIZER: frag[OUTER_OPTIMIZER]}}
    plist = [torch.nn.Parameter(frag[ORIGINAL_PARAMETERS][n].detach().to(torch.float32).clone()) for n in names]
    opt = outer_sgd(plist, outer)
    opt.load_state_dict(frag[OUTER_OPTIMIZER])
    for g in opt.param_groups:  # never the stored hyper-parameters
        g.update(outer.hyperparameters())
    with torch.no_grad():
        for n, p in zip(names, plist):
            acc = torch.zeros_like(p)
            for d, w in zip(deltas, weights):
                acc.add_(d[n], alpha=float(w))
            p.grad = acc
    opt.step()
    dtypes = {n: frag[ORIGINAL_PARAMETERS][n].dtype for n in names}
    return {FRAGMENT_KEY: {ORIGINAL_PARAMETERS: {n: p.detach().to(dtypes[n]).clone() for n, p in zip(names, plist)},
                           OUTER_OPTIMIZER: opt.state_dict()}}


__all__ = ["FRAGMENT_KEY", "initial_state", "outer_step", "token_weights"]
