"""Every Redis key name of the directory, in one place (style after arq).

Keys of one session share the hash tag ``{<session-id>}`` and keys of one worker share ``{w:<worker-id>}``,
so each Lua script touches keys of one hash slot only and the directory also runs on Redis Cluster.
Cross-entity indexes (the session list, the worker list, the deadline queue) are single keys updated
beside the atomic step; they are derived data, repaired by the state manager's scans.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    """Key builder bound to a prefix (one prefix per deployment or per test run)."""

    prefix: str = "substrate"

    # sessions ---------------------------------------------------------------------------------------
    def session(self, sid: str) -> str:
        """Hash: the session record (see ``substrate.models.SessionRecord``)."""
        return f"{self.prefix}:{{{sid}}}:session"

    def session_events(self, sid: str) -> str:
        """Pub/sub channel: state changes of one session (wakes parked requests in other routers)."""
        return f"{self.prefix}:{{{sid}}}:events"

    def session_epoch_floor(self, sid: str) -> str:
        """String: the last epoch a deleted session of this ID reached (a tombstone with a TTL), so a
        re-created session starts above it: epochs never repeat for an ID while a zombie may live."""
        return f"{self.prefix}:{{{sid}}}:epochfloor"

    def session_snapshots(self, sid: str) -> str:
        """Sorted set: committed snapshot refs (JSON) -> createdAt (s), the newest ``retention`` kept."""
        return f"{self.prefix}:{{{sid}}}:snapshots"

    @property
    def sessions_index(self) -> str:
        """Sorted set: session id -> createdAt (s). Listing and pagination."""
        return f"{self.prefix}:sessions"

    @property
    def snapshot_location(self) -> str:
        """String: the snapshot store this directory's sessions keep their snapshots in
        (``substrate.storeloc``)."""
        return f"{self.prefix}:snapshot:location"

    @property
    def snapshot_location_holders(self) -> str:
        """Hash: runtime process id -> ``<until (Unix s)> <store location>``: the runtimes running on this
        directory and the store each uses, held while they run (``substrate.storeloc.hold``)."""
        return f"{self.prefix}:snapshot:holders"

    @property
    def snapshot_store_id(self) -> str:
        """String: the id in the marker object of this directory's snapshot store (``snapshot.guard``)."""
        return f"{self.prefix}:snapshot:store-id"

    @property
    def snapshot_store_marked(self) -> str:
        """String: set once a store showed this directory's marker (``snapshot.guard``)."""
        return f"{self.prefix}:snapshot:store-marked"

    def snapshot_missing(self, object_key: str) -> str:
        """String with a TTL: when a snapshot object was first found missing (``snapshot.guard``)."""
        return f"{self.prefix}:snapshot:missing:{object_key}"

    @property
    def deadlines(self) -> str:
        """Sorted set: session id -> deadline (s) of its current transitional state."""
        return f"{self.prefix}:deadlines"

    # workers ----------------------------------------------------------------------------------------
    def worker(self, wid: str) -> str:
        """Hash: the worker record (address, pool, slots, state, lease)."""
        return f"{self.prefix}:{{w:{wid}}}:worker"

    def worker_slots(self, wid: str) -> str:
        """Hash: slot index -> session id, for occupied slots of one worker."""
        return f"{self.prefix}:{{w:{wid}}}:slots"

    @property
    def workers_index(self) -> str:
        """Sorted set: worker id -> lease expiry (s)."""
        return f"{self.prefix}:workers"

    # pools (demand and capacity notes shared by routers and the pool controller) ---------------------
    @property
    def pool_demand(self) -> str:
        """Hash: process id -> JSON ``{"at": s, "pools": {pool: [waiting, inFlight, activations]}}``, what
        each router process waits for (``substrate.demand``)."""
        return f"{self.prefix}:pool-demand"

    @property
    def pool_demand_channel(self) -> str:
        """Pub/sub channel: a router's placement found no free slot (the pool controller reconciles now)."""
        return f"{self.prefix}:pool-demand:wanted"

    @property
    def pool_capacity(self) -> str:
        """Hash: pool -> JSON ``{"at": s, "starting": n, "blocked": why}``, written by the pool controller."""
        return f"{self.prefix}:pool-capacity"

    @property
    def stats(self) -> str:
        """Hash: runtime-wide counters (worker-seconds integral, ...)."""
        return f"{self.prefix}:stats"

    @property
    def state_counts(self) -> str:
        """Hash: lifecycle state -> number of sessions in it (moved by transitions, repaired by a scan)."""
        return f"{self.prefix}:state-counts"
    # tenancy, auth, quotas, audit (issue 10) ---------------------------------------------------------
    def tenant_state_counts(self, tenant: str) -> str:
        """Hash: lifecycle state -> number of ``tenant``'s sessions in it (as :meth:`state_counts`, per tenant;
        its own hash slot beside the tenant's other keys)."""
        return f"{self.prefix}:{{t:{tenant}}}:state-counts"

    def tenant_sessions(self, tenant: str) -> str:
        """Sorted set: session id -> createdAt (s) of one tenant's sessions (keyset listing per tenant)."""
        return f"{self.prefix}:{{t:{tenant}}}:sessions"

    def quota(self, tenant: str, what: str) -> str:
        """Quota bookkeeping of one tenant (one hash tag, so the Lua check touches one slot):
        ``running``/``total`` sets of session ids, ``gpus`` hash session -> GPUs, ``creates`` sorted set
        of create times; ``<what>:<template>`` for the same per ActorTemplate; ``owner`` and ``inflight``
        (tenant only: ``substrate.quotas``)."""
        return f"{self.prefix}:{{t:{tenant}}}:quota:{what}"

    def session_audit(self, sid: str) -> str:
        """Stream: audit records of one session (capped; expires some time after the session is deleted)."""
        return f"{self.prefix}:{{{sid}}}:audit"

    def tenant_audit(self, tenant: str) -> str:
        """Stream: audit records of one tenant (capped)."""
        return f"{self.prefix}:{{t:{tenant}}}:audit"

    @property
    def api_keys(self) -> str:
        """Hash: sha256(API key) hex -> JSON {id, tenant, admin, name, createdAt}."""
        return f"{self.prefix}:auth:apikeys"

    @property
    def auth_version(self) -> str:
        """Integer bumped on every key change; also the pub/sub channel routers listen on."""
        return f"{self.prefix}:auth:version"

    @property
    def catalogs(self) -> str:
        """Hash: process ID -> JSON {digest, pools, templates, at, pid, host}: the WorkerPools and ActorTemplates
        each control-plane process of the deployment serves from its config folder (``substrate.catalogcheck``)."""
        return f"{self.prefix}:catalogs"

    @property
    def signing_keys(self) -> str:
        """Hash: key id -> secret of the activation-token signing keys, plus ``current`` -> key id."""
        return f"{self.prefix}:auth:signing"
