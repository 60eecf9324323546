"""Transfer metrics of one PD server, in that server's registry (so /metrics exports them)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import Collector

TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


class PDMetrics:
    """Built before the server's registry exists (with the PD side); `attach` adds them to it."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.transfer_bytes = Counter("dsv4_pd_transfer_bytes", "KV bytes written to (prefill) or received by "
                                      "(decode) this server", registry=registry)
        self.transfer_seconds = Histogram("dsv4_pd_transfer_seconds", "Wall time of one request's KV write "
                                          "(prefill) or wait for it (decode)", buckets=TRANSFER_BUCKETS,
                                          registry=registry)
        self.pages_in_flight = Gauge("dsv4_pd_pages_in_flight", "KV pages reserved for a transfer that has not "
                                     "completed", registry=registry)
        self.transfers = Counter("dsv4_pd_transfers", "Request KV transfers by outcome", ["outcome"],
                                 registry=registry)
        # Staged transfer: slots of the staging arena held by requests (decode: from the request's
        # arrival to its KV landing in its pages; prefill: one gather + write). 0 when idle, else a leak.
        self.staging_slots_in_use = Gauge("dsv4_pd_staging_slots_in_use", "Staging arena slots held by KV "
                                          "transfers in flight (staged transfer mode)", registry=registry)
        self.staging_bytes_in_use = Gauge("dsv4_pd_staging_bytes_in_use", "Staging arena bytes held by KV "
                                          "transfers in flight (staged transfer mode)", registry=registry)

        # Decode side: rooms given up before their KV arrived are closed on the prefill server before
        # their pages go back (`DecodeSide._close_then_release`), by outcome: "closed" (confirmed: no
        # write can land), "refused" (no prefill server listening), "unconfirmed" (no answer in time, an
        # error), "no_route" (a prefill server older than the close route: 404).
        self.room_closes = Counter("dsv4_pd_room_closes", "Rooms given up by the decode side and closed on "
                                   "their prefill server, by outcome", ["outcome"], registry=registry)
        # An unconfirmed close's pages and receive slot stay out of the pools while a write may still
        # land in them: until a retried close is confirmed (or refused). Not 0 for long means memory
        # lost to a prefill server that does not answer (or is too old to: a log line says which).
        self.quarantined_pages = Gauge("dsv4_pd_quarantined_pages", "KV pages kept out of the pool because "
                                       "a late KV write into them could not be ruled out", registry=registry)
        self.quarantined_staging_slots = Gauge("dsv4_pd_quarantined_staging_slots", "Staging arena slots kept "
                                               "out of the arena because a late KV write into them could not "
                                               "be ruled out", registry=registry)
        # Quarantines lifted by a retried close, by its outcome ("closed" or "refused").
        self.quarantines_lifted = Counter("dsv4_pd_quarantines_lifted", "Quarantined rooms whose pages and "
                                          "staging slot went back once a retried close ruled out a late KV "
                                          "write, by outcome", ["outcome"], registry=registry)

        # Prefill side: streamed requests' first tokens sent to the router to relay, by whether they were
        # ("relayed") or went the decode side's way ("not_relayed": a stop token, a room failed first).
        self.first_tokens = Counter("dsv4_pd_first_tokens", "First tokens of streamed requests the router asked "
                                    "this prefill server to relay, by outcome", ["outcome"], registry=registry)

    def track_staging(self, arena) -> None:
        """Read the arena's own counts at each scrape (a StagingArena; never set by hand, so they
        cannot drift from it)."""
        self.staging_slots_in_use.set_function(lambda: arena.slots_in_use)
        self.staging_bytes_in_use.set_function(lambda: arena.bytes_in_use)

    def attach(self, registry: CollectorRegistry) -> None:
        collectors: list[Collector] = [self.transfer_bytes, self.transfer_seconds, self.pages_in_flight,
                                       self.transfers, self.staging_slots_in_use, self.staging_bytes_in_use,
                                       self.room_closes, self.quarantined_pages, self.quarantined_staging_slots,
                                       self.quarantines_lifted, self.first_tokens]
        for collector in collectors:
            registry.register(collector)
