"""The benchmark tree: scenario scripts, the echo and bare-proxy floors, model makers,
throwaway certificates and the process harness. It is not installed; run it from a checkout
(`python -m perf.faults` from the repository root). What `sluice perf` runs is sluice.perf."""
