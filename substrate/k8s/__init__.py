"""Kubernetes mode: Pods for WorkerPools, DRA claim templates, API watches, leader election.

Modules: ``pods`` (worker Pod builder), ``dra`` (accelerator attributes -> ResourceClaimTemplate),
``snapshot_uri`` (``s3://``/``gs://`` -> store settings), ``api`` (client construction, informers),
``leader`` (Lease election), ``status`` (WorkerPool status with stable conditions), ``controller``
(the pool controller over the API: catalog sync, rollout, finalizer). Sessions never become API objects
(DESIGN invariant 4): the only objects written are Pods, ResourceClaimTemplates, PodGroups, one Lease and
the WorkerPools' status.
"""
