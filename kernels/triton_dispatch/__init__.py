"""Token dispatch kernels of the `low_latency` (fixed-capacity) and `all_to_all` (variable-size)
dispatchers (all2all/low_latency.py, all2all/all_to_all.py).

Each step is one Triton kernel on CUDA and a torch reference elsewhere (the oracle of the tests),
device-only and free of host synchronisation: route (slot of every (destination, token) pair),
pack (the fixed-capacity send buffer, every row written) or pack_var (the rows actually sent, back
to back by destination), unpack / unpack_var (dense routing metadata of the received rows; the
fixed-capacity one also the per-source counts) and combine (each token's rows gathered back and
summed). Import the functions from `ops`; importing this package loads no Triton (tests set
TRITON_INTERPRET first).
"""
