"""Fixed-capacity token dispatch kernels of the `low_latency` dispatcher (all2all/low_latency.py).

Four steps, each one Triton kernel on CUDA and a torch reference elsewhere (the oracle of the
tests), all device-only and free of host synchronisation, so they can be captured in a CUDA graph:
route (slot of every (destination, token) pair), pack (the send buffer, every row written),
unpack (dense routing metadata and the per-source counts of the received rows) and combine
(each token's rows gathered back and summed). Import the functions from `ops`; importing this
package loads no Triton (tests set TRITON_INTERPRET first).
"""
