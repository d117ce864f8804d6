"""The lease book: the scheduler's state with persistence and liveness, the one owner of a run's
state while it is served (`book.LeaseBook`), its reports, leases and records."""
