"""`sluice perf`: the load sweep (sweep) and what it runs on: the load generators (loadgen,
h2engine), their histograms (stats) and the report. The benchmarks are the checkout's perf/."""
