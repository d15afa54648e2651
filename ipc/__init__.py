"""ignis.ipc: the typed messages between clients and the GPU process, their msgpack codec, and ZeroMQ queues."""
