"""How a router's picks spread over the expert-parallel ranks under forced balance: the statistics the
communication model (destinations of a token) and the compute model (the busiest rank's load) share.

Forced balance (``moe_router_force_load_balancing``) replaces the router's logits with independent standard
normal draws (megatron-core ``RandomSTE.forward``: ``logits.clone().normal_()`` under the expert-parallel RNG
tracker, a different seed on every rank), so every token picks a uniformly random set of experts -- balanced
only on average.
"""

from __future__ import annotations

import functools
import heapq
import math
import random
import statistics
from collections import Counter

from primuspipe.projection.model_spec import ModelSpec

def destinations(model: ModelSpec, experts_each: int) -> float:
    """Distinct destinations (ranks, or nodes) one token's ``k`` experts live on, on average, where each
    destination holds ``experts_each`` consecutive experts (Megatron gives EP rank ``r`` experts
    ``r E/EP`` ... ``(r+1) E/EP - 1``).

    Without group-limited routing a router picks ``k`` distinct experts out of ``E``, every set alike (forced
    balance: random logits), so a destination is missed with probability ``C(E - n, k) / C(E, k)``. With it
    (``moe_router_num_groups`` / ``moe_router_group_topk``) a token's experts lie in its picked groups only,
    and which groups are picked depends on the scores' values, not only their order: see
    :func:`_group_limited_destinations`."""
    experts, k = model.num_experts, model.moe_router_topk
    if model.moe_router_group_topk is None:
        return experts / experts_each * (1 - math.comb(experts - experts_each, k) / math.comb(experts, k))
    return _group_limited_destinations(experts, k, model.moe_router_num_groups, model.moe_router_group_topk,
                                       experts_each, _group_score(model))


def _group_score(model: ModelSpec) -> str:
    """What megatron-core's ``topk_routing_with_score_function`` ranks groups by: sigmoid (or sqrt-softplus)
    scores, softmax probabilities with ``moe_router_pre_softmax``, else the raw logits (softmax comes after)."""
    if model.moe_router_score_function != "softmax":
        return model.moe_router_score_function
    return "exp" if model.moe_router_pre_softmax else "logit"


_SCORE = {"logit": lambda x: x, "exp": math.exp, "sigmoid": lambda x: 1 / (1 + math.exp(-x)),
          "sqrtsoftplus": lambda x: math.sqrt(math.log1p(math.exp(x)))}
_NORMAL = statistics.NormalDist()
ROUTED_TOKENS = 4096
"""Tokens :func:`_group_limited_destinations` routes: the count's standard error is under 0.01 destinations
for DeepSeek-V3's shapes (its spread over tokens is about 0.2 at EP 8, 0.6 at EP 64)."""


@functools.lru_cache(maxsize=64)
def _group_limited_destinations(experts: int, k: int, groups: int, picked: int, experts_each: int,
                                score: str) -> float:
    """Mean distinct destinations of ``ROUTED_TOKENS`` tokens routed as megatron-core's ``group_limited_topk``
    routes them under forced balance: logits standard normal and independent (``RandomSTE``: ``normal_()``),
    groups of ``E / groups`` consecutive experts ranked by the sum of their top ``k // picked`` scores, the
    ``picked`` best groups kept, and the ``k`` best experts among them chosen.

    No closed form is known for this count: a group's rank depends on the values of its best scores, and a
    picked group can still lose all its experts to the other picked groups. So the routes are drawn, from a
    fixed seed (the count is the same on every run): uniform ``u`` per expert, whose order is the logits'
    order; only the ``k // picked`` best of each group are turned into logits (``NormalDist().inv_cdf``) and
    scores to rank the groups."""
    return sum(len({e // experts_each for e in chosen}) for chosen in _drawn_routes(experts, k, groups, picked, score)
               ) / ROUTED_TOKENS


@functools.cache
def _drawn_routes(experts: int, k: int, groups: int, picked: int, score: str) -> tuple[tuple[int, ...], ...]:
    """The experts of ``ROUTED_TOKENS`` tokens routed by ``group_limited_topk`` under forced balance (see
    :func:`_group_limited_destinations`), from a fixed seed."""
    rng, size, best = random.Random(0), experts // groups, k // picked
    scale = _SCORE[score]
    routes = []
    for _ in range(ROUTED_TOKENS):
        u = [rng.random() for _ in range(experts)]
        tops = [sorted(range(g * size, (g + 1) * size), key=u.__getitem__, reverse=True)[:k] for g in range(groups)]
        rank = sorted(range(groups), key=lambda g: sum(scale(_NORMAL.inv_cdf(u[e])) for e in tops[g][:best]),
                      reverse=True)
        routes.append(tuple(heapq.nlargest(k, (e for g in rank[:picked] for e in tops[g]), key=u.__getitem__)))
    return tuple(routes)


def busiest_rank_load(model: ModelSpec, ep: int, tokens: float) -> float:
    """The busiest of ``ep`` ranks' token copies over the mean, expected, when ``tokens`` tokens of one microbatch
    (every rank's, the whole expert-parallel group's) are routed at random under forced balance.

    A rank holding ``n = E / ep`` consecutive experts receives ``c`` of a token's ``k`` copies; over ``N``
    independent tokens its load is ``N E[c]`` with variance ``s^2 = N Var(c)``, nearly normal. The ``ep`` loads
    are exchangeable and sum to ``N k``, so they are distributed as ``s sqrt(ep / (ep - 1))`` times ``ep``
    independent standard normal draws less their mean, and the busiest exceeds the mean by
    ``s sqrt(ep / (ep - 1))`` times the expected largest draw (:func:`expected_normal_maximum`). Every layer
    waits for it: the all-to-all's combine cannot end before the busiest rank's experts have run. Without
    groups ``c`` is hypergeometric (``k n/E (1 - n/E) (E - k)/(E - 1)``); with group-limited routing its variance
    is counted over the drawn routes (:func:`_drawn_routes`)."""
    if ep <= 1 or tokens <= 0:
        return 1.0
    experts, k = model.num_experts, model.moe_router_topk
    each = experts // ep
    mean = k * each / experts
    if model.moe_router_group_topk is None:
        variance = k * each / experts * (1 - each / experts) * (experts - k) / (experts - 1)
    else:
        variance = _group_limited_variance(experts, k, model.moe_router_num_groups, model.moe_router_group_topk,
                                           each, _group_score(model))
    return 1 + expected_normal_maximum(ep) * math.sqrt(ep / (ep - 1) * variance / tokens) / mean


@functools.lru_cache(maxsize=64)
def _group_limited_variance(experts: int, k: int, groups: int, picked: int, experts_each: int, score: str) -> float:
    """Variance of the copies of one token a destination of ``experts_each`` consecutive experts receives, over
    the drawn routes (:func:`_drawn_routes`) and the ``experts / experts_each`` destinations alike."""
    routes = _drawn_routes(experts, k, groups, picked, score)
    squares = sum(sum(c * c for c in Counter(e // experts_each for e in route).values()) for route in routes)
    destinations = experts // experts_each
    return squares / (len(routes) * destinations) - (k / destinations) ** 2


@functools.cache
def expected_normal_maximum(n: int) -> float:
    """E[max of ``n`` independent standard normal draws] = integral of ``x n phi(x) Phi(x)^(n-1)`` (0 for one draw;
    1.4236 for 8, 2.3437 for 64), by the midpoint rule over |x| < 10 in steps of 1/200."""
    step = 1 / 200
    xs = (-10 + (i + 0.5) * step for i in range(int(20 / step)))
    return sum(x * n * _NORMAL.pdf(x) * _NORMAL.cdf(x) ** (n - 1) for x in xs) * step
