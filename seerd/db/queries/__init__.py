"""Every read and write of a run's database made outside `seerd/db`, one module per entity
(Prefect's `models/`): functions take a connection or a session and never commit, the caller
owning the transaction. Statuses are the enums of `seerd.db.status`, never spelled as strings;
status changes go through `seerd.db.transitions`. Readers open the database with
`seerd.db.read` (read-only, one transaction per snapshot) and query it here; the lease book's
hot path writes through `leasing`, whose statements are built once."""

from seerd.db.queries import chunks, events, groups, history, requests, responses, rollouts, targets, workers

__all__ = ["chunks", "events", "groups", "history", "requests", "responses", "rollouts", "targets", "workers"]
