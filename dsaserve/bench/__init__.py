"""`dsaserve bench`: the serving benchmark client (workloads, backends, timing, report)."""
