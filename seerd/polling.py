"""How long a lease call waits for work. The coordinator, the worker and the simulator (which must
answer calls in the daemon's order) share these, from a module that imports nothing heavy."""

LONG_POLL_MAX_S = 5.0  # the coordinator holds an empty lease call at most this long
LEASE_LONG_POLL_S = 1.0  # what a worker asks for: a freed slot is noticed soon, idling stays cheap
