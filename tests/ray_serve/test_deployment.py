"""``shapecache.ray_serve.deployment``: the Serve deployment it makes (no cluster started).
Ray 2.60's Deployment has no public getter for its router or health-check settings: they are
read from its ``_deployment_config``."""

from __future__ import annotations

import pytest

from shapecache.ray_serve import CachedReplica, deployment
from shapecache.ray_serve._deployment import HEALTH_CHECK_PERIOD_S


class Sized(CachedReplica):
    size_keys = ("size",)


def test_the_deployment_routes_by_size_and_checks_its_replicas_health_every_two_seconds(tmp_path):
    made = deployment(Sized, shared_dir=tmp_path, num_replicas=3, stats_period_s=1.5)
    config = made._deployment_config
    assert config.health_check_period_s == HEALTH_CHECK_PERIOD_S == 2.0  # Serve's default: 10 s
    router = config.request_router_config
    assert router.request_router_class.endswith("SizeAffinityRouter")
    assert router.request_router_kwargs["size_keys"] == ["size"]
    assert router.request_routing_stats_period_s == 1.5 and router.request_router_kwargs["stats_max_age_s"] == 30.0
    assert made.num_replicas == 3
    assert made.ray_actor_options["runtime_env"]["env_vars"]["SHAPECACHE_SHARED_DIR"] == str(tmp_path)
    # the user's own period stays
    assert deployment(Sized, health_check_period_s=7.0)._deployment_config.health_check_period_s == 7.0


@pytest.mark.parametrize("arguments, error, named", [
    ({"replica_class": object}, TypeError, "replica_class=<class 'object'>: expected a subclass"),
    ({"stats_period_s": 0}, ValueError, "stats_period_s=0: expected a positive number"),
    ({"stats_period_s": 40, "stats_max_age_s": 30}, ValueError, "the age must exceed the period"),
    ({"request_router_config": None}, TypeError, "request_router_config: deployment\\(\\) sets it"),
])
def test_bad_arguments_are_named(arguments, error, named):
    replica_class = arguments.pop("replica_class", Sized)
    with pytest.raises(error, match=named):
        deployment(replica_class, **arguments)
