"""SizeAffinityRouter inside Ray Serve's own router machinery, without a cluster: the replicas
are Ray's RunningReplica over a RunningReplicaInfo carrying the routing stats a CachedReplica
publishes, without the actor handle (nothing here sends a request or probes a queue).
tests/ray_serve/test_ray_app.py runs the router in a real app."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("ray.serve", reason="the ray extra is not installed")

from ray.serve._private.common import (  # noqa: E402
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
    RunningReplicaInfo,
)
from ray.serve.request_router import PendingRequest, RunningReplica  # noqa: E402

from shapecache.ray_serve._placement import COUNTS, routing_stats  # noqa: E402
from shapecache.ray_serve._router import SizeAffinityRouter  # noqa: E402

MiB = 1 << 20


DEPLOYMENT = DeploymentID(name="d", app_name="a")


class Replica(RunningReplica):
    def __init__(self, unique_id, sizes=(), bytes=0, budget=100 * MiB):  # RunningReplica's own fetches the actor
        figures = {"bytes": bytes, "budget": budget, "entries": [{}] * len(sizes), "pending_builds": 0,
                   **dict.fromkeys(COUNTS, 0)}
        self._replica_info = RunningReplicaInfo(
            replica_id=ReplicaID(unique_id=unique_id, deployment_id=DEPLOYMENT), node_id="n", node_ip="127.0.0.1",
            availability_zone=None, actor_name=f"SERVE_REPLICA::a#d#{unique_id}", max_ongoing_requests=4,
            routing_stats=routing_stats(sizes, figures, time.time()))
        self._multiplexed_model_ids = set()


def request(n, **kwargs):
    return PendingRequest(args=[], kwargs=kwargs, metadata=RequestMetadata(request_id=str(n), internal_request_id=f"i{n}"))


def make_router(*replicas, **options):
    router = SizeAffinityRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**{"size_keys": ["size"], **options})
    router.update_replicas(list(replicas))
    return router


def ids(ranks):
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_a_held_size_goes_to_its_holder_and_ray_backs_off_between_tries():
    async def run():
        a, b = Replica("a", [(8, 8)], bytes=90 * MiB), Replica("b", [(16, 16)])
        router = make_router(a, b)
        held = request(1, size=(8, 8))
        assert ids(await router.choose_replicas([a, b], held)) == [["a"]]
        assert held.routing_context.should_backoff
        new = request(2, size=(32, 32))
        assert ids(await router.choose_replicas([a, b], new)) == [["b"], ["a"]]  # most room first, then any

    asyncio.run(run())


def test_new_sizes_offered_before_any_is_accepted_spread():
    async def run():
        a, b = Replica("a"), Replica("b")
        router = make_router(a, b)
        # a choice counts from when it is offered to Ray, not from when a replica accepts it
        first = ids(await router.choose_replicas([a, b], request(1, size=(32, 32))))[0]
        second = ids(await router.choose_replicas([a, b], request(2, size=(48, 48))))[0]
        assert sorted(first + second) == ["a", "b"]

    asyncio.run(run())


def test_a_request_without_a_size_goes_by_ray_s_default_policy():
    async def run():
        a, b = Replica("a", [(8, 8)]), Replica("b")
        router = make_router(a, b)
        ranks = ids(await router.choose_replicas([a, b], request(1, prompt="a cat")))
        assert len(ranks) == 1 and sorted(ranks[0]) == ["a", "b"]  # power of two choices

    asyncio.run(run())


def test_a_replica_found_for_a_request_goes_to_that_request_not_the_oldest():
    async def run():
        router = make_router(Replica("a"), Replica("b"))
        older, newer = request(1, size=(8, 8)), request(2, size=(16, 16))
        for pending in (older, newer):
            router._pending_requests_to_fulfill.append(pending)
            router._add_pending_request_to_indices(pending)
        router._fulfill_next_pending_request("b's replica", newer.metadata)
        assert newer.future.result() == "b's replica" and not older.future.done()

    asyncio.run(run())


def test_a_dead_replica_s_sizes_are_placed_again():
    async def run():
        a, b = Replica("a"), Replica("b", bytes=50 * MiB)
        router = make_router(a, b)
        router.on_request_routed(request(1, size=(8, 8)), a.replica_id, None)
        assert ids(await router.choose_replicas([a, b], request(2, size=(8, 8)))) == [["a"]]
        router.on_replica_actor_died(a.replica_id)
        assert ids(await router.choose_replicas([b], request(3, size=(8, 8)))) == [["b"]]

    asyncio.run(run())


def test_a_failing_policy_falls_back_to_ray_s_default(caplog):
    async def run():
        a, b = Replica("a", [(8, 8)]), Replica("b")
        router = make_router(a, b)

        def broken(*args, **kwargs):
            raise RuntimeError("policy bug")

        router._placement.rank = broken
        with caplog.at_level("ERROR", logger="shapecache"):
            ranks = ids(await router.choose_replicas([a, b], request(1, size=(8, 8))))
        assert len(ranks) == 1 and sorted(ranks[0]) == ["a", "b"]
        assert "routing by Ray's default policy" in caplog.text

    asyncio.run(run())


@pytest.mark.parametrize(("options", "match"), [
    ({"max_pending_builds": 0}, "max_pending_builds=0"),
    ({"spill_after_s": -1}, "spill_after_s=-1"),
    ({"stats_max_age_s": "60"}, "stats_max_age_s='60'"),
    ({"colour": 1}, "unknown request_router_kwargs"),
    ({"size_keys": ""}, "size_keys=''"),
])
def test_bad_router_options_are_named(options, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make_router(Replica("a"), **options)


def test_a_publication_is_parsed_once_and_a_new_one_is_seen():
    async def run():
        a, b = Replica("a", [(8, 8)]), Replica("b")
        router = make_router(a, b)
        first = router._states_of([a, b])
        again = router._states_of([a, b])
        assert first[0] is again[0] and first[0].sizes == {(8, 8)}  # the same publication: not parsed again
        # a publishes again (a later published_at): its new sizes are what the router sees
        a._replica_info = Replica("a", [(8, 8), (16, 16)])._replica_info
        assert router._states_of([a, b])[0].sizes == {(8, 8), (16, 16)}
        assert ids(await router.choose_replicas([a, b], request(1, size=(16, 16)))) == [["a"]]
        router.update_replicas([b])  # a is gone: what it published is forgotten
        assert set(router._parsed) <= {"b"}

    asyncio.run(run())
