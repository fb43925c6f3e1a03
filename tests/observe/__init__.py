"""toolkit.observe: the memory estimator, memory fit and monitor, FLOPs/MFU and the trackers' dashboards."""
