"""SizeAffinityRouter: Ray Serve's request router for shapecache replicas. Each request goes
to a replica that holds its size (``_placement.py`` has the policy and its rules); a request
without a size goes by Ray's default policy, power of two choices.

Ray Serve makes one router per deployment handle (and one per proxy), so each keeps its own
recent choices; two routers can place one new size on two replicas before either replica
publishes, after which both hold it and both are its homes.

Built on Ray's public router surface (``ray.serve.request_router``: RequestRouter and the
locality and multiplex mixins, which Ray's own default router is made of; alpha in Ray 2.60,
and the ``ray`` extra pins the versions tested). Two fields it reads or writes are documented
fields of the public PendingRequest whose types Ray does not mark public: the request's
``routing_context.should_backoff`` (set, as Ray's own mixins and routers set it, so that a home
that is full is retried with backoff, not in a busy loop; there is no public setter) and its
``metadata.multiplexed_model_id`` (read only for the default policy's multiplex branch).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time

from ray.serve.request_router import LocalityMixin, MultiplexMixin, RequestRouter

from shapecache.ray_serve._placement import FORMAT_KEY, SPILL_AFTER_S, Placement, ReplicaState
from shapecache.ray_serve._request_size import PIPELINE_SIZE_KEYS, check_size_keys, request_size

logger = logging.getLogger("shapecache")


class SizeAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Routes each request to a replica that holds its size. Options, given as
    ``request_router_kwargs``: ``size_keys`` (the keyword arguments that make a request's
    size; default ``("height", "width")``), ``max_pending_builds`` (a replica with this many
    background builds pending, or a request building, gets no new sizes; default 2), ``stats_max_age_s`` (routing stats older
    than this count as missing; default 60), ``spill_after_s`` (a request whose size's homes
    have not taken it after this long may go to any replica; default 10)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.initialize_state()  # Ray calls it again with the deployment's request_router_kwargs

    # No FIFOMixin: a replica found for a request goes to that request (RequestRouter's own
    # matching). Ray's default router gives it to the oldest request waiting, which here would
    # be a request of another size, whose home may be another replica.

    def initialize_state(self, size_keys=PIPELINE_SIZE_KEYS, max_pending_builds: int = 2,
                         stats_max_age_s: float = 60.0, spill_after_s: float = SPILL_AFTER_S, **kwargs) -> None:
        if kwargs:
            raise TypeError(f"SizeAffinityRouter got unknown request_router_kwargs {sorted(kwargs)}: expected "
                            "size_keys, max_pending_builds, stats_max_age_s, spill_after_s")
        self._size_keys = check_size_keys(size_keys)
        if isinstance(max_pending_builds, bool) or not isinstance(max_pending_builds, int) or max_pending_builds < 1:
            raise ValueError(f"max_pending_builds={max_pending_builds!r}: expected a positive int")
        for name, value in (("stats_max_age_s", stats_max_age_s), ("spill_after_s", spill_after_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}={value!r}: expected a positive number of seconds")
        self._placement = Placement(max_pending_builds=max_pending_builds, stats_max_age_s=float(stats_max_age_s),
                                    spill_after_s=float(spill_after_s))
        # replica id -> (the publication's published_at, its state as parsed): a replica
        # publishes every few seconds, and requests come far more often.
        self._parsed: dict[str, tuple[object, ReplicaState]] = {}

    def _size_of(self, pending_request) -> tuple[int, ...] | None:
        if pending_request is None:
            return None
        return request_size(pending_request.kwargs, self._size_keys)

    def _states_of(self, replicas) -> list[ReplicaState]:
        # Full: its last known queue is at max_ongoing_requests (what select_available_replicas
        # leaves out; an unknown queue counts as room).
        available = {replica.replica_id for replica in self.select_available_replicas(replicas)}
        states = []
        for r in replicas:
            state, full = self._published(r.replica_id.unique_id, r.routing_stats), r.replica_id not in available
            states.append(state if state.full == full else dataclasses.replace(state, full=full))
        return states

    def _published(self, replica_id: str, stats: object) -> ReplicaState:
        """What `replica_id` published, parsed once per publication (one published_at)."""
        try:
            stamp = stats[FORMAT_KEY]["published_at"]
            hash(stamp)
        except (KeyError, TypeError, IndexError):
            stamp = None  # not a publication of this format: parsed each time (it holds nothing)
        kept = self._parsed.get(replica_id)
        if stamp is not None and kept is not None and kept[0] == stamp:
            return kept[1]
        state = ReplicaState.from_routing_stats(replica_id, stats)
        self._parsed[replica_id] = (stamp, state)
        return state

    def _power_of_two_choices(self, pending_request):
        """Ray's default policy (its PowerOfTwoChoicesRequestRouter.choose_replicas): two replicas
        at random among those its multiplex or locality rules prefer; Ray then takes the one with
        the shorter queue."""
        model = getattr(getattr(pending_request, "metadata", None), "multiplexed_model_id", "")
        if model:
            candidates = self.apply_multiplex_routing(pending_request=pending_request)
        else:
            candidates = self.apply_locality_routing(pending_request=pending_request)
        replicas = self.curr_replicas
        chosen = [replicas[i] for i in random.sample(tuple(candidates), k=min(2, len(candidates))) if i in replicas]
        return [chosen] if chosen else []

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        size = self._size_of(pending_request)
        ranks = None
        if size is not None:
            try:
                now = time.time()
                ranks = self._placement.rank(size, self._states_of(candidate_replicas), now,
                                             waited_s=now - pending_request.created_at)
            except Exception:  # noqa: BLE001 - a request is never lost to the policy: Ray's default routes it
                logger.exception("shapecache: size-affinity routing failed; routing by Ray's default policy")
                ranks = None
        if ranks is None:
            return self._power_of_two_choices(pending_request)
        # Sent to the first choice until it answers or its replica publishes: a burst of new
        # sizes routed before any is accepted spreads instead of landing on one replica.
        self._placement.routed(size, ranks[0][0], time.time())
        # Ray retries choose_replicas until a rank takes the request; with backoff between the
        # tries (without it, a home that is full or does not answer is probed in a busy loop).
        pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[replica_id] for replica_id in rank] for rank in ranks]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        size, now = self._size_of(pending_request), time.time()
        self._placement.routed(size, replica_id.unique_id, now)
        self._placement.requested(size, now)

    def update_replicas(self, replicas) -> None:
        super().update_replicas(replicas)
        self._forget_gone_replicas()

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget_gone_replicas()

    def _forget_gone_replicas(self) -> None:
        current = {replica_id.unique_id for replica_id in self.curr_replicas}
        self._placement.keep_only(current)
        for gone in set(self._parsed) - current:
            del self._parsed[gone]
