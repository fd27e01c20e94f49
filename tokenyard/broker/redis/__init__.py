"""The Redis Streams backend (Redis >= 6.2, Valkey >= 7.2, Redis Cluster): Lua scripts, keys,
the channel, and an embedded Valkey for `serve`, tests and benchmarks."""
