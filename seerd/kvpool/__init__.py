"""The job's Mooncake KV pool: its address file, the master + metadata service the coordinator
owns (`service.PoolService`), store clients (`store.open_store`) and the per-node process that
contributes the pool's memory (`holder`)."""
