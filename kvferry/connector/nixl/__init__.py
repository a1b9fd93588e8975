"""NIXL P/D connector (pull). Module map:

connector.py       NixlConnector: the connector API, routed to the two halves
scheduler_side.py  scheduler half: holds (prefill), handshake/validate/check/load (decode)
worker_side.py     worker half: registration, the transfer thread
serve.py           prefill side of the side channel: handshakes and the lease protocol
leases.py          lease table: hold, check, heartbeat, done/ACK, release, expiry
loads.py           decode side: READs, Done, ACKs
plan.py            READ descriptors: head slices (heterogeneous TP), layout conversion
regions.py         registration from KVCacheConfig, compatibility hash
agent.py           the NIXL agent (no progress thread)
channel.py         ZMQ side channel: ROUTER server, DEALER clients
protocol.py        side-channel messages (msgspec)
params.py          the kv_transfer_params contract
metadata.py        per-step metadata, settings
validate.py        decode side: params against the remote's handshake
"""
