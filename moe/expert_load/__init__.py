"""Expert load: the counters the forward fills on the device (counters.py, worker side), the
engine core's totals and recording windows (tracker.py) and the JSON-lines recording file the
dashboard reads (recording.py)."""
