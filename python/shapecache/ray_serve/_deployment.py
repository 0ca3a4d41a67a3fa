"""``deployment``: a CachedReplica class as a Ray Serve deployment routed by size, in one call."""

from __future__ import annotations

import copy

from shapecache import _checks
from shapecache.ray_serve._placement import SPILL_AFTER_S
from shapecache.ray_serve._replica import CachedReplica
from shapecache.ray_serve._shared_dir import SharedDir

# How often each replica publishes what it holds (Ray's default is 10 s). A size placed since
# the last publication is remembered by the router that placed it, so a longer period costs
# only the accuracy of the room each replica reports.
STATS_PERIOD_S = 2.0
# How often Serve checks each replica's health (Ray's default is 10 s). Ray Serve 2.60 learns
# that a replica's actor died (killed, out of memory) only from its next health check
# (serve/_private/deployment_state.py, ActorReplicaWrapper.check_health), and starts the
# replacement then: the dead replica's sizes crowd the replicas left meanwhile. A check is one
# small actor call; its timeout (health_check_timeout_s, 30 s) does not change.
HEALTH_CHECK_PERIOD_S = 2.0


def deployment(replica_class: type, *, shared_dir=None, max_pending_builds: int = 2,
               stats_period_s: float = STATS_PERIOD_S, stats_max_age_s: float | None = None,
               spill_after_s: float = SPILL_AFTER_S, **options):
    """``serve.deployment(replica_class, **options)`` with the size-affinity router.

    `replica_class`: a subclass of ``CachedReplica``; its ``size_keys`` tell the router where a
    request's size is. `shared_dir` (default: SHAPECACHE_SHARED_DIR, when set): the directory
    the replicas share, passed to them in their ``runtime_env``. `max_pending_builds`: a
    replica with this many background builds pending gets no new sizes. `stats_period_s`:
    how often replicas publish what they hold; stats older than `stats_max_age_s` (default:
    five periods, at least 30 s) count as missing, and the router falls back to Ray's default
    policy for sizes it has no home for. `spill_after_s`: a request whose size's homes have not
    taken it after this long (none answered Ray's queue-length probe in time) may go to any
    replica; one whose homes are all at ``max_ongoing_requests`` may at once. `options`: any other ``serve.deployment`` option
    (``num_replicas``, ``ray_actor_options``, ``max_ongoing_requests``...); ``health_check_period_s``
    defaults to HEALTH_CHECK_PERIOD_S (2 s, where Serve's is 10 s), so that a replica that died is
    replaced seconds sooner."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from shapecache.ray_serve._router import SizeAffinityRouter

    if not (isinstance(replica_class, type) and issubclass(replica_class, CachedReplica)):
        raise TypeError(f"replica_class={replica_class!r}: expected a subclass of shapecache.ray_serve.CachedReplica")
    _checks.positive_int("max_pending_builds", max_pending_builds, "builds")
    for name, value in (("stats_period_s", stats_period_s), ("stats_max_age_s", stats_max_age_s),
                        ("spill_after_s", spill_after_s)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"{name}={value!r}: expected a positive number of seconds")
    if "request_router_config" in options:
        raise TypeError("request_router_config: deployment() sets it (the size-affinity router); use "
                        "serve.deployment to choose another router")
    if stats_max_age_s is None:
        stats_max_age_s = max(30.0, 5 * stats_period_s)
    if stats_max_age_s <= stats_period_s:
        raise ValueError(f"stats_max_age_s={stats_max_age_s!r} with stats_period_s={stats_period_s!r}: the age must "
                         "exceed the period, or every replica's stats count as missing")
    router = RequestRouterConfig(
        request_router_class=SizeAffinityRouter,
        request_router_kwargs={"size_keys": list(replica_class.size_keys), "max_pending_builds": max_pending_builds,
                               "stats_max_age_s": stats_max_age_s, "spill_after_s": spill_after_s},
        request_routing_stats_period_s=stats_period_s,
    )
    options.setdefault("health_check_period_s", HEALTH_CHECK_PERIOD_S)
    shared = SharedDir.from_option(shared_dir)
    if shared is not None:
        actor_options = copy.deepcopy(options.get("ray_actor_options") or {})
        runtime_env = actor_options.setdefault("runtime_env", {})
        runtime_env["env_vars"] = {**shared.environment(), **runtime_env.get("env_vars", {})}
        options["ray_actor_options"] = actor_options
    return serve.deployment(replica_class, request_router_config=router, **options)
